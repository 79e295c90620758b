"""The tree's half (the scheduler thread): start, drain, terminate, insert and release.

In flow order: ``prefetch`` (every rank queues the op) -> ``drain_hits`` (each agreed hit is
revoked on every rank, or given a bounce buffer of exactly the hit on every rank) ->
``drain_acks`` (progress applied while the op is current; a final ack inserts ``[0:published]``
of a current op and queues the rest for release) -> ``terminate`` (marks the op, inserts
``[0:published]`` now, retires it; the rest waits for the final ack, INV-23) ->
``drain_releases`` (the release queue into the host pool). ``write_storage`` ->
``drain_backup_acks`` (the ack releases the source's host lock; the ack must name only pages
L3 holds, byte-equal: the window "an acked backup is readable", INV-26).

Each drain takes the MIN over ranks of its queue's length, as upstream's
``drain_storage_control_queues`` does, so every rank takes the same entries.
"""

from __future__ import annotations

from hicache_ref.oracle.state import evolve, replace_at
from hicache_ref.oracle.storage.keys import compute_io_owned
from hicache_ref.oracle.storage.state import (
    ABSENT,
    FINAL,
    FREED,
    GOOD,
    INSERTED,
    IO_OWNED,
    RELEASING,
    BackupView,
    PrefetchView,
    RankState,
    StorageState,
    with_backup,
    with_prefetch,
    with_rank,
    with_storage_fault,
)


def start_prefetch(state: StorageState, op: int) -> StorageState:
    """``prefetch_from_storage`` on every rank: the op is current and queued for its query."""
    for rank, rank_state in enumerate(state.ranks):
        rank_state = with_prefetch(rank_state, op, PrefetchView(issued=True, current=True))
        rank_state = evolve(rank_state, prefetch_queue=(*rank_state.prefetch_queue, op))
        state = with_rank(state, rank, rank_state)
    return state


def start_backup(state: StorageState, op: int) -> StorageState:
    """``write_storage`` on every rank, the source pages locked until the op's ack."""
    for rank, rank_state in enumerate(state.ranks):
        rank_state = with_backup(rank_state, op, BackupView(issued=True, source_held=True))
        rank_state = evolve(rank_state, backup_queue=(*rank_state.backup_queue, op))
        state = with_rank(state, rank, rank_state)
    return state


def drain_count(state: StorageState, queue: str) -> int:
    """How many entries of ``queue`` every rank has (what a drain takes)."""
    return min(len(getattr(rank_state, queue)) for rank_state in state.ranks)


def drain_hits(state: StorageState, no_room: tuple[int, ...] = ()) -> StorageState:
    """Revoke each drained hit on every rank, or start its transfer on every rank."""
    for _ in range(drain_count(state, "hit_queue")):
        taken = [rank_state.hit_queue[0] for rank_state in state.ranks]
        ranks = [evolve(r, hit_queue=r.hit_queue[1:]) for r in state.ranks]
        views = [r.prefetches[op] for r, op in zip(ranks, taken, strict=True)]
        start = all(v.current and not v.terminated and v.hit >= 1 for v in views)
        start = start and not set(taken) & set(no_room)
        for rank, (rank_state, op, view) in enumerate(zip(ranks, taken, views, strict=True)):
            if start:
                view = evolve(view, bounce=(ABSENT,) * view.hit, owner=(IO_OWNED,) * view.hit)
                rank_state = evolve(rank_state, buffer=(*rank_state.buffer, op))
            elif view.current:
                view = evolve(view, current=False)  # revoked: no buffer, no IO, no acks
            state = with_rank(state, rank, with_prefetch(rank_state, op, view))
    return state


def drain_acks(state: StorageState) -> StorageState:
    """Apply each rank's next drained prefetch acks (the same count on every rank)."""
    count = drain_count(state, "ack_queue")
    for rank in range(len(state.ranks)):
        for _ in range(count):
            rank_state = state.ranks[rank]
            (op, value), rest = rank_state.ack_queue[0], rank_state.ack_queue[1:]
            state = with_rank(state, rank, evolve(rank_state, ack_queue=rest))
            state = _apply_ack(state, rank, op, value)
    return state


def _apply_ack(state: StorageState, rank: int, op: int, value: int) -> StorageState:
    view = state.ranks[rank].prefetches[op]
    if value != FINAL:
        if not view.current:
            return state  # the op was retired (terminated): its progress is frozen
        # Verify applied progress only grows (INV-19)
        if value < view.published:
            state = with_storage_fault(
                state,
                "INV-19",
                f"rank {rank}: progress of prefetch op {op} went back {view.published} -> {value}",
            )
        return _set_view(state, rank, op, evolve(view, published=value))
    # Verify one final ack per prefetch (INV-25)
    if view.final_drained >= 1:
        state = with_storage_fault(
            state, "INV-25", f"rank {rank}: the tree drained a second final ack of op {op}"
        )
    view = evolve(view, final_drained=view.final_drained + 1)
    state = _set_view(state, rank, op, view)
    if view.current:
        state = insert_published(state, rank, op)
    return release_tail(state, rank, op)


def _set_view(state: StorageState, rank: int, op: int, view: PrefetchView) -> StorageState:
    return with_rank(state, rank, with_prefetch(state.ranks[rank], op, view))


def insert_published(state: StorageState, rank: int, op: int) -> StorageState:
    """The tree inserts ``[0:published]`` of ``op``'s buffer and retires the op."""
    view = state.ranks[rank].prefetches[op]
    owner = view.owner
    for page in range(view.published):
        tag = view.bounce[page]
        # Verify an inserted page was counted only once its key's bytes landed (INV-19, INV-30)
        if tag != GOOD:
            state = with_storage_fault(
                state,
                "INV-19" if tag == ABSENT else "INV-30",
                f"rank {rank} inserted page {page} of prefetch op {op} holding "
                f"{'nothing' if tag == ABSENT else 'other bytes'} (published {view.published})",
            )
        owner = replace_at(owner, page, INSERTED)
    return _set_view(state, rank, op, evolve(view, owner=owner, current=False))


def release_tail(state: StorageState, rank: int, op: int) -> StorageState:
    """Queue ``[published:]`` of ``op``'s buffer for release (after its final ack)."""
    view = state.ranks[rank].prefetches[op]
    owned_from, owned_to = compute_io_owned(
        len(view.bounce), view.published, view.final_drained > 0
    )
    owner = view.owner
    queued: tuple[tuple[int, int], ...] = ()
    for page in range(view.published, len(view.bounce)):
        # Verify no page the IO may still write is released (INV-23)
        if owned_from <= page < owned_to:
            state = with_storage_fault(
                state,
                "INV-23",
                f"rank {rank} released page {page} of prefetch op {op} before its final ack "
                "was drained (its IO may still write it)",
            )
        if owner[page] == IO_OWNED:
            owner = replace_at(owner, page, RELEASING)
            queued += ((op, page),)
    rank_state = with_prefetch(state.ranks[rank], op, evolve(view, owner=owner))
    rank_state = evolve(rank_state, release_queue=(*rank_state.release_queue, *queued))
    return with_rank(state, rank, rank_state)


def terminate(state: StorageState, op: int) -> StorageState:
    """``terminate_prefetch`` on every rank, then the tree settles ``[0:published]``."""
    for rank in range(len(state.ranks)):
        view = state.ranks[rank].prefetches[op]
        state = _set_view(state, rank, op, evolve(view, terminated=True))
        if not view.bounce:
            state = _set_view(state, rank, op, evolve(view, terminated=True, current=False))
            continue
        state = insert_published(state, rank, op)
        if state.config.variant.terminate_releases_tail:  # planted: the tail goes back now
            state = release_tail(state, rank, op)
    return state


def drain_backup_acks(state: StorageState) -> StorageState:
    """Each drained backup ack releases its source's host lock; what it reports must be in L3."""
    count = drain_count(state, "backup_acks")
    for rank in range(len(state.ranks)):
        for _ in range(count):
            rank_state = state.ranks[rank]
            (op, value), rest = rank_state.backup_acks[0], rank_state.backup_acks[1:]
            rank_state = evolve(rank_state, backup_acks=rest)
            state = with_rank(state, rank, rank_state)
            state = _check_backup_ack(state, rank, rank_state, op, value)
            view = rank_state.backups[op]
            view = evolve(view, source_held=False, acks_drained=view.acks_drained + 1)
            state = with_rank(state, rank, with_backup(state.ranks[rank], op, view))
    return state


def _check_backup_ack(
    state: StorageState, rank: int, rank_state: RankState, op: int, value: int
) -> StorageState:
    view = rank_state.backups[op]
    if view.acks_drained >= 1:
        state = with_storage_fault(
            state, "INV-25", f"rank {rank}: the tree drained a second backup ack of op {op}"
        )
    # Verify the ack reports the stored prefix, and every page it names reads back (INV-26)
    if value != view.stored:
        state = with_storage_fault(
            state,
            "INV-26",
            f"rank {rank}: backup op {op} acked {value} pages; the backend holds a prefix of "
            f"{view.stored}",
        )
    keys = state.config.op_keys(op)
    for page in range(value):
        key = keys[page] if page < len(keys) else -1
        tag = rank_state.l3[key] if key >= 0 else ABSENT
        if tag != GOOD and (rank, key) not in state.lost:
            what = "nothing" if tag == ABSENT else "other bytes"
            state = with_storage_fault(
                state,
                "INV-26",
                f"rank {rank}: backup op {op} acked page {page}, but L3 holds {what} under its "
                "key when the tree drains the ack (an acked backup is readable)",
            )
    return state


def drain_releases(state: StorageState) -> StorageState:
    """Free every queued page (the same count on every rank): its content is gone."""
    count = drain_count(state, "release_queue")
    for rank, rank_state in enumerate(state.ranks):
        for op, page in rank_state.release_queue[:count]:
            view = rank_state.prefetches[op]
            if page < len(view.owner):
                view = evolve(
                    view,
                    owner=replace_at(view.owner, page, FREED),
                    bounce=replace_at(view.bounce, page, ABSENT),
                )
                rank_state = with_prefetch(rank_state, op, view)
        rank_state = evolve(rank_state, release_queue=rank_state.release_queue[count:])
        state = with_rank(state, rank, rank_state)
    return state
