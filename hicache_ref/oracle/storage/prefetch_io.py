"""The prefetch IO thread (T2, ``prefetch_io_aux_func``) and the sync thread (T3,
``prefetch_sync_thread_func``).

T2's points, per prefetch: ``idle`` (``prefetch_buffer.get``) -> per batch ``check`` (the
termination check under the op's lock; a terminated op reads nothing more) -> ``get``
(``batch_get`` of the batch: the leading pages that came back, stopping at the first missing
one and at a termination seen after the read; each counted page's bytes land first, INV-19) ->
with ``page_points``, per page read back ``land`` (its bytes set and counted; the termination
check before each page, so a termination between two page writes cuts the batch there); with
``lock_points`` that check is a point of its own, ``recheck``, before each page read back ->
``progress`` (``prefetch_sync_queue.put`` of the cumulative count, one per batch even after a
failure or termination, INV-20) -> after the last batch ``final`` (the ``completed_req`` ack,
exactly once, INV-25).

T3's points: ``idle`` (``prefetch_sync_queue.get``) -> ``reduce`` (``all_reduce(MIN)``, group
``completion``; a final ack has none) -> ``publish`` (``ack_prefetch_queue.put``; the value is
the MIN over ranks, INV-21).

The IO's ghosts: ``seen_term`` (the termination its check saw: a read after it is the window
"no read after an observed termination", INV-19) and ``first_hole`` (the first page a read did
not return: progress past it is the window "progress never past a hole", INV-19).
"""

from __future__ import annotations

from hicache_ref.oracle.state import evolve, replace_at
from hicache_ref.oracle.storage.keys import compute_batch_range, count_batches
from hicache_ref.oracle.storage.ops import Advance
from hicache_ref.oracle.storage.state import (
    ABSENT,
    BAD,
    FINAL,
    IO,
    IO_OWNED,
    SYNC,
    PrefetchView,
    StorageState,
    Thread,
    with_prefetch,
    with_rank,
    with_storage_fault,
    with_thread,
)


def advance_io(state: StorageState, op: Advance) -> StorageState:
    """T2 of ``op.rank`` takes the action it is parked at and runs to its next point."""
    rank_state = state.ranks[op.rank]
    thread = rank_state.threads[IO]
    point = thread.point
    if point == "idle":
        prefetch = rank_state.buffer[0]
        rank_state = evolve(rank_state, buffer=rank_state.buffer[1:])
        moved = Thread(point="check", op=prefetch, epoch=thread.epoch)
        return with_rank(state, op.rank, with_thread(rank_state, IO, moved))
    view = rank_state.prefetches[thread.op]
    if point == "check":
        seen = view.terminated
        ok = thread.ok and not (seen and not state.config.variant.io_ignores_termination)
        if ok:
            moved = evolve(thread, point="get", seen_term=seen)
        else:  # a batch skipped after a failure or a termination still gets its ack
            moved = evolve(thread, point="progress", batch=thread.batch + 1, ok=False)
        return with_rank(state, op.rank, with_thread(rank_state, IO, moved))
    if point == "get":
        return _batch_get(state, op, thread, view)
    if point == "recheck":  # lock points: the termination check before one page lands
        if view.terminated:  # the rest of the batch is not counted
            moved = evolve(thread, point="progress", landing=(), ok=False)
        elif state.config.page_points:
            moved = evolve(thread, point="land")
        else:
            return _land_next(state, op.rank, thread)
        return with_rank(state, op.rank, with_thread(rank_state, IO, moved))
    if point == "land":  # page points: one page's bytes set, then the next page's check
        return _land_next(state, op.rank, thread)
    if point == "progress":
        entry = (thread.op, thread.value)
        rank_state = evolve(rank_state, sync_queue=(*rank_state.sync_queue, entry))
        batches = count_batches(len(view.bounce), state.config.batch_pages)
        following = "final" if thread.batch >= batches else "check"
        moved = evolve(thread, point=following)
        return with_rank(state, op.rank, with_thread(rank_state, IO, moved))
    assert point == "final", point
    rank_state = evolve(rank_state, sync_queue=(*rank_state.sync_queue, (thread.op, FINAL)))
    rank_state = with_prefetch(rank_state, thread.op, evolve(view, final_put=view.final_put + 1))
    # Verify one final ack per prefetch (INV-25)
    if view.final_put >= 1:
        state = with_storage_fault(
            state, "INV-25", f"rank {op.rank} put a second final ack for prefetch op {thread.op}"
        )
    return with_rank(state, op.rank, with_thread(rank_state, IO, Thread(epoch=thread.epoch)))


def _batch_get(
    state: StorageState, op: Advance, thread: Thread, view: PrefetchView
) -> StorageState:
    """``batch_get`` of batch ``thread.batch`` into the bounce buffer (or its deferral)."""
    variant = state.config.variant
    # Verify the IO reads nothing of an op whose termination its check saw (window, INV-19)
    if thread.seen_term and not thread.pending:
        state = with_storage_fault(
            state,
            "INV-19",
            f"rank {op.rank}'s IO read batch {thread.batch} of prefetch op {thread.op} after its "
            "check saw the termination (no backend read after an observed termination)",
        )
    rank_state = state.ranks[op.rank]
    if op.outcome == "defer":  # issued; it returns at this thread's next point
        moved = evolve(thread, pending=True)
        return with_rank(state, op.rank, with_thread(rank_state, IO, moved))
    start, end = compute_batch_range(thread.batch, state.config.batch_pages, len(view.bounce))
    keys = state.config.op_keys(thread.op)
    if op.outcome == "raise":
        view = _hole_at(view, start)
        if variant.io_raise_skips_final_ack:  # the exception escapes the loop: the thread dies
            rank_state = with_prefetch(rank_state, thread.op, view)
            dead = Thread(point="dead", epoch=thread.epoch)
            return with_rank(state, op.rank, with_thread(rank_state, IO, dead))
        returned: tuple[bool, ...] = (False,) * (end - start)
    else:
        returned = tuple(
            rank_state.l3[keys[p]] != ABSENT
            and not (op.outcome == "hole" and p == start + op.index)
            for p in range(start, end)
        )
    if state.config.page_points or state.config.lock_points:  # each page at its own points
        got_pages: list[tuple[int, int]] = []  # (page, the tag its read returned)
        for offset, got in enumerate(returned):
            if not got:
                view = _hole_at(view, start + offset)
                if variant.io_counts_past_hole:
                    continue  # planted: the wrong ``continue`` counts later pages
                break
            got_pages.append((start + offset, rank_state.l3[keys[start + offset]]))
        ok = thread.ok and (len(got_pages) == end - start or variant.io_counts_past_hole)
        state = with_rank(state, op.rank, with_prefetch(rank_state, thread.op, view))
        moved = evolve(thread, batch=thread.batch + 1, ok=ok, pending=False)
        return _next_landing(state, op.rank, moved, tuple(got_pages))
    count = 0
    for offset, got in enumerate(returned):
        page = start + offset
        if not got:
            view = _hole_at(view, page)
            if variant.io_counts_past_hole:
                continue  # planted: the wrong ``continue`` counts later pages
            break
        if view.terminated:
            break  # the page's bytes are not set once the op is terminated
        state = with_rank(state, op.rank, with_prefetch(state.ranks[op.rank], thread.op, view))
        count += 1
        tag = state.ranks[op.rank].l3[keys[page]]
        state = _land(state, op.rank, thread.op, page, tag, thread.value + count)
        view = state.ranks[op.rank].prefetches[thread.op]
    ok = thread.ok and (count == end - start or variant.io_counts_past_hole)
    view = evolve(view, local=thread.value + count)
    rank_state = with_prefetch(state.ranks[op.rank], thread.op, view)
    moved = evolve(
        thread, point="progress", batch=thread.batch + 1, value=thread.value + count, ok=ok,
        pending=False,
    )  # fmt: skip
    return with_rank(state, op.rank, with_thread(rank_state, IO, moved))


def _land_next(state: StorageState, rank: int, thread: Thread) -> StorageState:
    """The first page of ``thread.landing`` lands (its bytes set, counted); then the next."""
    moved = evolve(thread, value=thread.value + 1)
    page, tag = thread.landing[0]
    state = _land(state, rank, thread.op, page, tag, moved.value)
    return _next_landing(state, rank, moved, thread.landing[1:])


def _next_landing(
    state: StorageState, rank: int, thread: Thread, landing: tuple[tuple[int, int], ...]
) -> StorageState:
    """Page or lock points: park for the next page read back (at ``recheck`` with lock points,
    else at ``land`` after its termination check), unless none is left or that check stops
    the batch (the rest is not counted)."""
    terminated = state.ranks[rank].prefetches[thread.op].terminated
    if landing and state.config.lock_points:
        moved = evolve(thread, point="recheck", landing=landing)
    elif landing and not terminated:
        moved = evolve(thread, point="land", landing=landing)
    else:
        moved = evolve(thread, point="progress", landing=(), ok=thread.ok and not landing)
    return with_rank(state, rank, with_thread(state.ranks[rank], IO, moved))


def _land(state: StorageState, rank: int, op: int, page: int, tag: int, local: int) -> StorageState:
    """The IO sets the bytes of bounce page ``page`` of prefetch ``op`` to ``tag`` (what its
    read returned); it has counted ``local`` pages of it then."""
    rank_state = state.ranks[rank]
    view = rank_state.prefetches[op]
    # Verify L3 gave back the bytes written under the key (INV-30)
    if tag == BAD:
        state = with_storage_fault(
            state,
            "INV-30",
            f"rank {rank}'s batch_get of page {page} returned bytes other than its key's",
        )
    # Verify the IO writes only bounce pages it still owns (INV-23)
    if view.owner[page] != IO_OWNED:
        state = with_storage_fault(
            state,
            "INV-23",
            f"rank {rank}'s IO wrote page {page} of prefetch op {op} after the tree took it "
            f"(owner {view.owner[page]})",
        )
    view = evolve(view, bounce=replace_at(view.bounce, page, tag), local=local)
    return with_rank(state, rank, with_prefetch(state.ranks[rank], op, view))


def _hole_at(view: PrefetchView, page: int) -> PrefetchView:
    return view if view.first_hole >= 0 else evolve(view, first_hole=page)


def advance_sync(state: StorageState, op: Advance) -> StorageState:
    """T3 of ``op.rank`` takes the action it is parked at and runs to its next point."""
    rank_state = state.ranks[op.rank]
    thread = rank_state.threads[SYNC]
    if thread.point == "idle":
        prefetch, value = rank_state.sync_queue[0]
        rank_state = evolve(rank_state, sync_queue=rank_state.sync_queue[1:])
        if value == FINAL:
            moved = Thread(point="publish", op=prefetch, final=True, epoch=thread.epoch)
        else:
            moved = Thread(point="reduce", op=prefetch, value=value, epoch=thread.epoch)
        return with_rank(state, op.rank, with_thread(rank_state, SYNC, moved))
    assert thread.point == "publish", thread.point
    if thread.final:
        entry = (thread.op, FINAL)
    else:
        # Verify the published progress is the MIN over ranks (INV-21)
        if thread.value != thread.aux:
            state = with_storage_fault(
                state,
                "INV-21",
                f"rank {op.rank} published progress {thread.value} pages of prefetch op "
                f"{thread.op}; the MIN over ranks is {thread.aux}",
            )
        entry = (thread.op, thread.value)
    rank_state = evolve(rank_state, ack_queue=(*rank_state.ack_queue, entry))
    return with_rank(state, op.rank, with_thread(rank_state, SYNC, Thread(epoch=thread.epoch)))
