"""The backup thread (T4, ``backup_thread_func``): one ``write_storage`` from queue to ack.

T4's points: ``idle`` (``backup_queue.get``) -> per batch ``set`` (``batch_set`` of the batch's
source pages, in chain order; a failed or raising batch ends the backup, so L3 stays
prefix-closed, INV-31) -> ``ack`` (``ack_backup_queue.put`` of the stored prefix, exactly once,
INV-25 / INV-26). A page written while its source's host lock is held carries the key's bytes;
one written after the tree drained the ack (the lock released, the page reused) carries other
bytes (``BAD``): the window of an ack put before its write.
"""

from __future__ import annotations

from hicache_ref.oracle.state import evolve, replace_at
from hicache_ref.oracle.storage.keys import compute_batch_range, count_batches
from hicache_ref.oracle.storage.ops import Advance
from hicache_ref.oracle.storage.state import (
    BACKUP,
    BAD,
    GOOD,
    StorageState,
    Thread,
    with_backup,
    with_rank,
    with_storage_fault,
    with_thread,
)


def advance_backup(state: StorageState, op: Advance) -> StorageState:
    """T4 of ``op.rank`` takes the action it is parked at and runs to its next point."""
    rank_state = state.ranks[op.rank]
    thread = rank_state.threads[BACKUP]
    if thread.point == "idle":
        backup = rank_state.backup_queue[0]
        rank_state = evolve(rank_state, backup_queue=rank_state.backup_queue[1:])
        if state.config.variant.backup_ack_before_write:  # planted: ack every page first
            pages = state.config.ops[backup].pages
            moved = Thread(point="ack", op=backup, value=pages, epoch=thread.epoch)
        else:
            moved = Thread(point="set", op=backup, epoch=thread.epoch)
        return with_rank(state, op.rank, with_thread(rank_state, BACKUP, moved))
    if thread.point == "set":
        return _batch_set(state, op, thread)
    assert thread.point == "ack", thread.point
    view = rank_state.backups[thread.op]
    # Verify one ack per write_storage (INV-25)
    if view.acks_put >= 1:
        state = with_storage_fault(
            state, "INV-25", f"rank {op.rank} put a second backup ack for op {thread.op}"
        )
    rank_state = with_backup(rank_state, thread.op, evolve(view, acks_put=view.acks_put + 1))
    entry = (thread.op, thread.value)
    rank_state = evolve(rank_state, backup_acks=(*rank_state.backup_acks, entry))
    if state.config.variant.backup_ack_before_write and not thread.final:
        moved = Thread(point="set", op=thread.op, final=True, epoch=thread.epoch)
    else:
        moved = Thread(epoch=thread.epoch)
    return with_rank(state, op.rank, with_thread(rank_state, BACKUP, moved))


def _batch_set(state: StorageState, op: Advance, thread: Thread) -> StorageState:
    """``batch_set`` of batch ``thread.batch``: stored, refused (``fail``) or raising."""
    config = state.config
    rank_state = state.ranks[op.rank]
    view = rank_state.backups[thread.op]
    pages = config.ops[thread.op].pages
    start, end = compute_batch_range(thread.batch, config.batch_pages, pages)
    more = thread.batch + 1 < count_batches(pages, config.batch_pages)
    if op.outcome == "ok":
        tag = GOOD if view.source_held else BAD
        l3 = rank_state.l3
        keys = config.op_keys(thread.op)
        for page in range(start, end):
            l3 = replace_at(l3, keys[page], tag)
        # the ghost ``stored`` is the prefix the backend holds from page 0 on (INV-26)
        stored = view.stored + (end - start) if view.stored == start else view.stored
        rank_state = evolve(rank_state, l3=l3)
        rank_state = with_backup(rank_state, thread.op, evolve(view, stored=stored))
        value = thread.value + (end - start)
        go_on = more
    else:  # a refused or raising batch ends the backup (planted: a refused one is skipped)
        if op.outcome == "fail" and op.index:  # a partial batch: its first pages landed
            tag = GOOD if view.source_held else BAD
            keys = config.op_keys(thread.op)
            l3 = rank_state.l3
            for page in range(start, start + op.index):
                l3 = replace_at(l3, keys[page], tag)
            rank_state = evolve(rank_state, l3=l3)
        value = thread.value
        go_on = more and op.outcome == "fail" and config.variant.backup_skips_failed_batch
    if go_on:
        moved = evolve(thread, batch=thread.batch + 1, value=value)
    elif thread.final:  # planted backup_ack_before_write: the ack went out already
        moved = Thread(epoch=thread.epoch)
    else:
        moved = evolve(thread, point="ack", value=value)
    return with_rank(state, op.rank, with_thread(rank_state, BACKUP, moved))
