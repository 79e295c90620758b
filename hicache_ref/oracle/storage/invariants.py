"""The storage oracle's verdicts: ``check_storage_invariants(state)`` returns every
``Violation`` (INV-19..31 where a small world can express them, and the window properties of
the interleavings issue under the ids ``config.WINDOWS`` names).

Two kinds of verdict, as in the device oracle: *faults* recorded by the step that broke a rule
(a read after an observed termination, a second final ack, an old-epoch thread, collectives
paired across different calls, a backup ack naming pages L3 does not hold, a release of pages
the IO owns, ...), and *judges* of one state below. ``storage_quiescent`` is the state where no
storage thread can move and nothing waits for the tree: there a missing ack (INV-25) or a
thread stuck in a collective (INV-20) is final.
"""

from __future__ import annotations

from hicache_ref.oracle.state import Violation
from hicache_ref.oracle.storage.hit_query import collective_rule
from hicache_ref.oracle.storage.keys import compute_hit_endpoint
from hicache_ref.oracle.storage.ops import (
    Collective,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
)
from hicache_ref.oracle.storage.state import ABSENT, GROUPS, THREADS, StorageState
from hicache_ref.oracle.storage.step import thread_ops, why_storage_disabled

_DRAINS = (DrainHits(), DrainAcks(), DrainBackupAcks(), DrainReleases())


def check_storage_invariants(state: StorageState) -> list[Violation]:
    """Every violation in ``state``: the sticky faults, then each judge's findings."""
    found = list(state.faults)
    for judge in _JUDGES:
        found.extend(judge(state))
    return found


def storage_quiescent(state: StorageState) -> bool:
    """No storage thread can move (no ``Advance`` or ``Collective`` enabled) and nothing waits
    for the tree (no drain enabled)."""
    for rank in range(len(state.ranks)):
        for thread in range(len(THREADS)):
            if thread_ops(state, rank, thread):
                return False
    if any(collective_rule(state, Collective(g)) is None for g in GROUPS):
        return False
    return all(why_storage_disabled(state, drain) is not None for drain in _DRAINS)


def judge_progress_never_past_a_hole(state: StorageState) -> list[Violation]:
    """INV-19 (window): an IO's count never reaches past the first page its reads missed."""
    found = []
    for rank, rank_state in enumerate(state.ranks):
        for op, view in enumerate(rank_state.prefetches):
            if view.first_hole >= 0 and view.local > view.first_hole:
                found.append(
                    Violation(
                        "INV-19",
                        f"rank {rank}'s IO counted {view.local} pages of prefetch op {op}, past "
                        f"page {view.first_hole} its read did not get (progress past a hole)",
                    )
                )
    return found


def judge_published_is_min(state: StorageState) -> list[Violation]:
    """INV-21: no rank applies progress some rank's IO has not made."""
    found = []
    for op in range(len(state.config.ops)):
        views = [r.prefetches[op] for r in state.ranks]
        if not all(v.bounce for v in views):
            continue
        floor = min(v.local for v in views)
        for rank, view in enumerate(views):
            if view.published > floor:
                found.append(
                    Violation(
                        "INV-21",
                        f"rank {rank} applied progress {view.published} of prefetch op {op}; "
                        f"the MIN of the ranks' progress is {floor}",
                    )
                )
    return found


def judge_hit_endpoint(state: StorageState) -> list[Violation]:
    """INV-29: once every rank published a hit, it is the same MIN of the ranks' runs."""
    found = []
    for op in range(len(state.config.ops)):
        views = [r.prefetches[op] for r in state.ranks]
        if any(v.hit < 0 or v.hit_local < 0 for v in views):
            continue
        want = compute_hit_endpoint(tuple(v.hit_local for v in views), state.config.ops[op].pages)
        for rank, view in enumerate(views):
            if view.hit != want:
                found.append(
                    Violation(
                        "INV-29",
                        f"rank {rank} published hit {view.hit} of prefetch op {op}; the MIN of "
                        f"the ranks' runs is {want}",
                    )
                )
    return found


def judge_prefix_closed(state: StorageState) -> list[Violation]:
    """INV-31: every page L3 holds follows a held page (or one an injected fault lost)."""
    found = []
    for rank, rank_state in enumerate(state.ranks):
        for key, tag in enumerate(rank_state.l3):
            parent = state.config.parent_key(key)
            if tag == ABSENT or parent < 0:
                continue
            if rank_state.l3[parent] == ABSENT and (rank, parent) not in state.lost:
                found.append(
                    Violation(
                        "INV-31",
                        f"rank {rank}'s L3 holds key {key} of a chain without key {parent} before it",
                    )
                )
    return found


def judge_reset_clean(state: StorageState) -> list[Violation]:
    """INV-24: right after a reset or an attach nothing is queued and no thread is mid-op."""
    if not state.fresh_epoch:
        return []
    found = []
    for rank, rank_state in enumerate(state.ranks):
        if not (rank_state.thread_queues_empty() and rank_state.control_queues_empty()):
            found.append(Violation("INV-24", f"rank {rank} kept queued entries across a reset"))
        stale = [THREADS[i] for i, t in enumerate(rank_state.threads) if t.point != "idle"]
        if stale:
            found.append(
                Violation("INV-24", f"rank {rank}'s threads {stale} were not joined at the reset")
            )
    return found


def judge_detach_clean(state: StorageState) -> list[Violation]:
    """INV-24: after a detach no thread is mid-operation and no operation waits for one."""
    if state.attached:
        return []
    found = []
    for rank, rank_state in enumerate(state.ranks):
        busy = [THREADS[i] for i, t in enumerate(rank_state.threads) if t.point != "idle"]
        if busy or not rank_state.thread_queues_empty():
            found.append(
                Violation(
                    "INV-24",
                    f"rank {rank} detached with threads {busy} mid-operation or operations "
                    "queued (detach lets every operation reach its final ack first)",
                )
            )
    return found


def judge_quiescent_acks(state: StorageState) -> list[Violation]:
    """INV-25 / INV-20 at quiescence: every started prefetch drained one final ack, every
    backup one ack, and no thread waits in a collective its peers never join."""
    if not storage_quiescent(state):
        return []
    found = []
    for rank, rank_state in enumerate(state.ranks):
        for op, view in enumerate(rank_state.prefetches):
            if view.bounce and view.final_drained != 1:
                found.append(
                    Violation(
                        "INV-25",
                        f"quiescent, but rank {rank} drained {view.final_drained} final acks of "
                        f"prefetch op {op} (exactly one final ack)",
                    )
                )
        for op, backup in enumerate(rank_state.backups):
            if backup.issued and backup.acks_drained != 1:
                found.append(
                    Violation(
                        "INV-25",
                        f"quiescent, but rank {rank} drained {backup.acks_drained} acks of "
                        f"backup op {op}",
                    )
                )
        for index, thread in enumerate(rank_state.threads):
            if thread.point == "reduce":
                found.append(
                    Violation(
                        "INV-20",
                        f"quiescent, but rank {rank}'s {THREADS[index]} thread waits in an "
                        "all_reduce no other rank joins (a TP deadlock)",
                    )
                )
    return found


_JUDGES = (
    judge_progress_never_past_a_hole,
    judge_published_is_min,
    judge_hit_endpoint,
    judge_prefix_closed,
    judge_reset_clean,
    judge_detach_clean,
    judge_quiescent_acks,
)
