"""Epochs and the backend's own life: reset, detach, attach, clear, and a lost page.

``reset`` stops and joins every storage thread of every rank, drops every queue (the release
queue too: the host pool is cleared next) and starts the next epoch; no parked thread of the old
epoch runs again (INV-24). ``detach`` waits for every operation's final ack (its enabling rule);
``attach`` starts a new epoch. ``clear`` empties the clearing rank's own namespace only
(INV-28). ``lose_page`` is a backend that drops a page it held (``exists`` said yes, the read
finds nothing): an injected fault, so a page after it in L3 is no hole (INV-31).
"""

from __future__ import annotations

from hicache_ref.oracle.state import evolve, replace_at
from hicache_ref.oracle.storage.state import (
    ABSENT,
    StorageState,
    fresh_rank,
    with_rank,
    with_storage_fault,
)


def reset(state: StorageState) -> StorageState:
    """``reset`` of every rank: a new epoch, L3 kept (storage outlives the process's state)."""
    variant = state.config.variant
    epoch = state.epoch + 1
    ranks = []
    for rank, old in enumerate(state.ranks):
        fresh = fresh_rank(state.config, rank, epoch, old.l3)
        if variant.reset_keeps_old_thread:  # planted: the threads are not joined
            fresh = evolve(fresh, threads=old.threads)
        if variant.reset_keeps_release_queue:  # planted (sglang#26009)
            fresh = evolve(fresh, release_queue=old.release_queue)
        ranks.append(fresh)
    return evolve(
        state,
        ranks=tuple(ranks),
        epoch=epoch,
        resets_left=state.resets_left - 1,
        fresh_epoch=True,
    )


def detach(state: StorageState) -> StorageState:
    """Every live prefetch is marked terminated (``terminate_live_prefetches``: a hit still
    waiting for the tree is then revoked) and every thread stopped; what waits on the control
    queues stays for the tree."""
    ranks = tuple(
        evolve(
            r,
            prefetches=tuple(
                evolve(v, terminated=True) if v.issued and not v.terminated else v
                for v in r.prefetches
            ),
        )
        for r in state.ranks
    )
    return evolve(state, ranks=ranks, attached=False)


def attach(state: StorageState) -> StorageState:
    """A new epoch with fresh threads and queues, L3 as it was."""
    epoch = state.epoch + 1
    ranks = tuple(
        fresh_rank(state.config, rank, epoch, old.l3) for rank, old in enumerate(state.ranks)
    )
    return evolve(
        state,
        ranks=ranks,
        epoch=epoch,
        attached=True,
        fresh_epoch=True,
        resets_left=state.resets_left - 1,
    )


def clear(state: StorageState, rank: int) -> StorageState:
    """Rank ``rank``'s clear endpoint: its namespace is emptied (planted: every namespace)."""
    wiped = range(len(state.ranks)) if state.config.variant.clear_wipes_every_namespace else [rank]
    for target in wiped:
        rank_state = state.ranks[target]
        # Verify a clear removes only its own namespace (INV-28)
        if target != rank and any(tag != ABSENT for tag in rank_state.l3):
            state = with_storage_fault(
                state, "INV-28", f"rank {rank}'s clear removed pages of rank {target}'s namespace"
            )
        state = with_rank(state, target, evolve(rank_state, l3=(ABSENT,) * len(rank_state.l3)))
    lost = tuple(entry for entry in state.lost if entry[0] not in wiped)
    return evolve(state, lost=lost)


def lose_page(state: StorageState, rank: int, page: int) -> StorageState:
    """Rank ``rank``'s backend loses ``page`` (an injected fault: one of ``max_faults``)."""
    rank_state = state.ranks[rank]
    state = with_rank(state, rank, evolve(rank_state, l3=replace_at(rank_state.l3, page, ABSENT)))
    return evolve(state, lost=(*state.lost, (rank, page)), faults_left=state.faults_left - 1)
