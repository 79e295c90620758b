"""The hit query thread (T1, ``prefetch_thread_func``) and the collectives of both groups.

T1's points, in order: ``idle`` (``prefetch_queue.get``) -> with ``lock_points``, ``check`` (its
look at termination under the operation's lock) -> ``exists`` (``batch_exists`` of one
batch; the run stops at the first short batch) -> ``reduce`` (``all_reduce(MIN)`` of the hit,
group ``hits``: once per prefetch, hit or miss or terminated, INV-20) -> ``publish``
(``prefetch_hit_queue.put`` of the agreed hit, INV-29).

``run_collective`` is the joint point of every rank's thread of a group: it runs once all are
parked at it, pairs their k-th calls (a rank whose call is for another operation, or a per-batch
call against another rank's last call, is an INV-20 fault) and hands each the MIN.
"""

from __future__ import annotations

from hicache_ref.oracle.state import evolve
from hicache_ref.oracle.storage.keys import (
    compute_batch_range,
    compute_leading_run,
    reduce_min,
)
from hicache_ref.oracle.storage.ops import Advance, Collective
from hicache_ref.oracle.storage.state import (
    ABSENT,
    GROUP_THREAD,
    HIT_QUERY,
    StorageState,
    Thread,
    with_prefetch,
    with_rank,
    with_storage_fault,
    with_thread,
)


def advance_hit_query(state: StorageState, op: Advance) -> StorageState:
    """T1 of ``op.rank`` takes the action it is parked at and runs to its next point."""
    rank_state = state.ranks[op.rank]
    thread = rank_state.threads[HIT_QUERY]
    if thread.point == "idle":
        prefetch = rank_state.prefetch_queue[0]
        rank_state = evolve(rank_state, prefetch_queue=rank_state.prefetch_queue[1:])
        if state.config.lock_points:  # the termination check is a point of its own
            moved = Thread(point="check", op=prefetch, epoch=thread.epoch)
            return with_rank(state, op.rank, with_thread(rank_state, HIT_QUERY, moved))
        thread = Thread(point="check", op=prefetch, epoch=thread.epoch)
    if thread.point == "check":
        prefetch = thread.op
        view = rank_state.prefetches[prefetch]
        if view.terminated:  # a terminated prefetch hits nothing
            rank_state = with_prefetch(rank_state, prefetch, evolve(view, hit_local=0))
            moved = Thread(point="reduce", op=prefetch, final=True, epoch=thread.epoch)
        else:
            moved = Thread(point="exists", op=prefetch, epoch=thread.epoch)
        return with_rank(state, op.rank, with_thread(rank_state, HIT_QUERY, moved))
    if thread.point == "exists":
        return _batch_exists(state, op, thread)
    assert thread.point == "publish", thread.point
    view = rank_state.prefetches[thread.op]
    # Verify the agreed hit is within this rank's own run (INV-29: MIN never exceeds a run)
    if thread.value > thread.aux:
        state = with_storage_fault(
            state,
            "INV-29",
            f"rank {op.rank} published hit {thread.value} pages of op {thread.op} above its own "
            f"leading run of {thread.aux}",
        )
    rank_state = with_prefetch(rank_state, thread.op, evolve(view, hit=thread.value))
    rank_state = evolve(rank_state, hit_queue=(*rank_state.hit_queue, thread.op))
    idle = Thread(epoch=thread.epoch)
    return with_rank(state, op.rank, with_thread(rank_state, HIT_QUERY, idle))


def _batch_exists(state: StorageState, op: Advance, thread: Thread) -> StorageState:
    """``batch_exists`` of batch ``thread.batch``: the leading run of present pages, a hole
    reported at ``op.index``, or a raise (the query then counts as a miss: 0 pages)."""
    config = state.config
    rank_state = state.ranks[op.rank]
    pages = config.ops[thread.op].pages
    start, end = compute_batch_range(thread.batch, config.batch_pages, pages)
    if op.outcome == "raise":  # the query failed: a miss on this rank
        view = rank_state.prefetches[thread.op]
        rank_state = with_prefetch(rank_state, thread.op, evolve(view, hit_local=0))
        moved = evolve(thread, point="reduce", value=0, final=True)
        return with_rank(state, op.rank, with_thread(rank_state, HIT_QUERY, moved))
    present = tuple(rank_state.l3[key] != ABSENT for key in config.op_keys(thread.op))
    if op.outcome == "hole":
        present = tuple(p and i != start + op.index for i, p in enumerate(present))
    run = compute_leading_run(present, start, end)
    total = thread.value + run
    last = run < end - start or end == pages
    if last or config.variant.hit_sync_per_batch:
        view = rank_state.prefetches[thread.op]
        rank_state = with_prefetch(rank_state, thread.op, evolve(view, hit_local=total))
        moved = evolve(thread, point="reduce", value=total, batch=thread.batch + 1, final=last)
    else:
        moved = evolve(thread, batch=thread.batch + 1, value=total)
    return with_rank(state, op.rank, with_thread(rank_state, HIT_QUERY, moved))


def collective_rule(state: StorageState, op: Collective) -> str | None:
    """Why the ``op.group`` collective cannot return now (None: every rank's thread waits in it)."""
    if op.group not in GROUP_THREAD:
        return f"unknown collective group {op.group!r}; legal: {sorted(GROUP_THREAD)}"
    if not state.attached:
        return "storage is detached (no thread runs)"
    index = GROUP_THREAD[op.group]
    for rank, rank_state in enumerate(state.ranks):
        if rank_state.threads[index].point != "reduce":
            return f"rank {rank}'s thread is not parked in the {op.group} all_reduce"
    return None


def run_collective(state: StorageState, op: Collective) -> StorageState:
    """Every rank's thread of ``op.group`` leaves its ``all_reduce`` with the MIN."""
    index = GROUP_THREAD[op.group]
    threads = [rank_state.threads[index] for rank_state in state.ranks]
    calls = [(t.op, t.final) for t in threads]
    for rank, call in enumerate(calls[1:], start=1):
        # Verify every rank's k-th call of the group is for the same op and loop position
        if call != calls[0]:
            state = with_storage_fault(
                state,
                "INV-20",
                f"the {op.group} all_reduce paired rank 0's call (op {calls[0][0]}, last="
                f"{calls[0][1]}) with rank {rank}'s (op {call[0]}, last={call[1]}): the ranks "
                "issue different collectives",
            )
    agreed = reduce_min(tuple(t.value for t in threads))
    variant = state.config.variant
    for rank, thread in enumerate(threads):
        moved = _after_collective(variant.progress_not_reduced, op.group, thread, agreed)
        state = with_rank(state, rank, with_thread(state.ranks[rank], index, moved))
    return state


def _after_collective(not_reduced: bool, group: str, thread: Thread, agreed: int) -> Thread:
    if group == "hits":
        if not thread.final:  # planted hit_sync_per_batch: the query goes on with its own run
            return evolve(thread, point="exists")
        return evolve(thread, point="publish", value=agreed, aux=thread.value)
    own = thread.value if not_reduced else agreed  # planted progress_not_reduced keeps its own
    return evolve(thread, point="publish", value=own, aux=agreed)
