"""``why_storage_disabled`` and ``storage_step``: the storage oracle's one entry point.

``why_storage_disabled(state, op)`` is the discipline of the tree and of the threads' code
(which thread can run to its next point, which outcome a call may draw); ``storage_step``
applies an enabled op and returns ``(new_state, observations)``, raising
``OpNotEnabledError`` naming the rule otherwise. ``all_storage_ops(config)`` is the finite op
universe the exhaustive checker enumerates.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache_ref.oracle.state import Observation, evolve
from hicache_ref.oracle.step import OpNotEnabledError
from hicache_ref.oracle.storage import epochs, tree
from hicache_ref.oracle.storage.backup import advance_backup
from hicache_ref.oracle.storage.config import StorageConfig
from hicache_ref.oracle.storage.hit_query import advance_hit_query, collective_rule, run_collective
from hicache_ref.oracle.storage.keys import compute_batch_range
from hicache_ref.oracle.storage.ops import (
    Advance,
    Attach,
    Clear,
    Collective,
    Detach,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
    LosePage,
    Prefetch,
    Reset,
    StorageOp,
    Terminate,
    WriteStorage,
)
from hicache_ref.oracle.storage.prefetch_io import advance_io, advance_sync
from hicache_ref.oracle.storage.state import (
    ABSENT,
    BACKUP,
    GROUPS,
    HIT_QUERY,
    IO,
    SYNC,
    THREADS,
    RankState,
    StorageState,
    Thread,
    with_rank,
    with_storage_fault,
    with_thread,
)

StorageStep = tuple[StorageState, tuple[Observation, ...]]

CALL_OUTCOMES: dict[tuple[int, str], tuple[str, ...]] = {
    (HIT_QUERY, "exists"): ("ok", "hole", "raise"),
    (IO, "get"): ("ok", "hole", "raise", "defer"),
    (BACKUP, "set"): ("ok", "fail", "raise"),
}
"""The outcomes each backend call point may draw."""

_INPUT = {HIT_QUERY: "prefetch_queue", IO: "buffer", SYNC: "sync_queue", BACKUP: "backup_queue"}
_ADVANCE = {
    HIT_QUERY: advance_hit_query,
    IO: advance_io,
    SYNC: advance_sync,
    BACKUP: advance_backup,
}


def why_storage_disabled(state: StorageState, op: StorageOp) -> str | None:
    """Why ``op`` cannot happen in ``state`` (the rule), or None if it can."""
    config = state.config
    if isinstance(op, Advance):
        return _rule_advance(state, op)
    if isinstance(op, Collective):
        return collective_rule(state, op)
    if isinstance(op, Prefetch | WriteStorage | Terminate):
        return _rule_op(state, op)
    if isinstance(op, DrainHits | DrainAcks | DrainBackupAcks | DrainReleases):
        queue = {
            DrainHits: "hit_queue",  # (no_room names ops; any is legal)
            DrainAcks: "ack_queue",
            DrainBackupAcks: "backup_acks",
            DrainReleases: "release_queue",
        }[type(op)]
        return None if tree.drain_count(state, queue) else f"{queue} is empty on some rank"
    if isinstance(op, LosePage):
        if state.faults_left <= 0:
            return f"the world's max_faults={config.max_faults} are spent"
        if not 0 <= op.rank < config.ranks or not 0 <= op.page < config.pages:
            return f"rank {op.rank} / page {op.page} outside the world"
        return None if state.ranks[op.rank].l3[op.page] != ABSENT else "the page is not in L3"
    if isinstance(op, Reset):
        return None if state.resets_left > 0 else f"max_resets={config.max_resets} are spent"
    return _rule_epoch(state, op)


def _rule_op(state: StorageState, op: Prefetch | WriteStorage | Terminate) -> str | None:
    config = state.config
    if not 0 <= op.op < len(config.ops):
        return f"op {op.op} is outside the world's {len(config.ops)} ops"
    kind = config.ops[op.op].kind
    if isinstance(op, Terminate):
        if not config.terminations:
            return "this world draws no termination"
        if kind != "prefetch" or not all(r.prefetches[op.op].current for r in state.ranks):
            return "terminate_prefetch needs a current prefetch on every rank"
        return None
    want = "prefetch" if isinstance(op, Prefetch) else "backup"
    if kind != want:
        return f"op {op.op} is a {kind}, not a {want}"
    if not state.attached:
        return f"{want} needs an attached backend"
    views = state.ranks[0].prefetches if want == "prefetch" else state.ranks[0].backups
    return "each op is issued once per epoch" if views[op.op].issued else None


def _rule_advance(state: StorageState, op: Advance) -> str | None:
    config = state.config
    if not 0 <= op.rank < config.ranks or not 0 <= op.thread < len(THREADS):
        return f"rank {op.rank} / thread {op.thread} outside the world"
    if not state.attached:
        return "storage is detached (no thread runs)"
    rank_state = state.ranks[op.rank]
    thread = rank_state.threads[op.thread]
    if thread.point == "dead":
        return "the thread died of an exception"
    if thread.point == "idle" and not getattr(rank_state, _INPUT[op.thread]):
        return f"{_INPUT[op.thread]} is empty (the thread waits in get)"
    if thread.point == "reduce":
        return "the thread waits in an all_reduce (Collective returns it)"
    legal = CALL_OUTCOMES.get((op.thread, thread.point), ("ok",))
    if thread.pending:
        legal = tuple(o for o in legal if o != "defer")
    if op.outcome not in legal:
        return f"at {THREADS[op.thread]}.{thread.point} the outcome is one of {legal}"
    if op.outcome != "ok":
        if state.faults_left <= 0:
            return f"the world's max_faults={config.max_faults} are spent"
        if op.outcome in ("hole", "fail") and not (
            0 <= op.index < _batch_len(state, rank_state, thread)
        ):
            return f"{op.outcome} index {op.index} is outside the batch"
        if op.outcome not in ("hole", "fail") and op.index:
            return "only a hole or a failed write names an index"
    elif op.index:
        return "only a hole or a failed write names an index"
    return None


def _batch_len(state: StorageState, rank_state: RankState, thread: Thread) -> int:
    if thread.point == "get":
        pages = len(rank_state.prefetches[thread.op].bounce)
    else:
        pages = state.config.ops[thread.op].pages
    start, end = compute_batch_range(thread.batch, state.config.batch_pages, pages)
    return end - start


def _at_rest(state: StorageState) -> bool:
    return all(
        all(t.point == "idle" for t in r.threads) and r.thread_queues_empty() for r in state.ranks
    )


def _rule_epoch(state: StorageState, op: StorageOp) -> str | None:
    config = state.config
    settled = all(
        r.control_queues_empty()
        and not any(v.current for v in r.prefetches)
        and not any(b.source_held for b in r.backups)
        for r in state.ranks
    )
    if isinstance(op, Detach):
        if not config.detach or not state.attached:
            return "detach needs an attached world that draws detaches"
        if _at_rest(state) or config.variant.detach_with_work_in_flight:
            return None
        return "detach waits until every op reached its final ack"
    if isinstance(op, Attach):
        if not config.detach or state.attached:
            return "attach follows a detach"
        if state.resets_left <= 0:
            return f"max_resets={config.max_resets} (new epochs: resets and attaches) are spent"
        return None if settled else "attach needs the last detach's acks and releases drained"
    assert isinstance(op, Clear), op
    if not config.clear or not state.attached or not 0 <= op.rank < config.ranks:
        return "clear needs an attached world that draws clears, and a rank of it"
    return None if _at_rest(state) and settled else "clear_storage runs at rest"


def storage_step(state: StorageState, op: StorageOp) -> StorageStep:
    """Apply ``op``: ``(new_state, observations)``; raises ``OpNotEnabledError`` if disabled."""
    reason = why_storage_disabled(state, op)
    if reason is not None:
        raise OpNotEnabledError(f"{op} is not enabled: {reason}")
    new_state = _apply(state, op)
    if new_state.fresh_epoch and not isinstance(op, Reset | Attach) and new_state != state:
        new_state = evolve(new_state, fresh_epoch=False)
    return new_state, ()


def _apply(state: StorageState, op: StorageOp) -> StorageState:
    if isinstance(op, Advance):
        return _advance(state, op)
    if isinstance(op, Collective):
        return run_collective(state, op)
    if isinstance(op, Prefetch):
        return tree.start_prefetch(state, op.op)
    if isinstance(op, WriteStorage):
        return tree.start_backup(state, op.op)
    if isinstance(op, Terminate):
        return tree.terminate(state, op.op)
    if isinstance(op, DrainHits):
        return tree.drain_hits(state, op.no_room)
    if isinstance(op, DrainAcks):
        return tree.drain_acks(state)
    if isinstance(op, DrainBackupAcks):
        return tree.drain_backup_acks(state)
    if isinstance(op, DrainReleases):
        return tree.drain_releases(state)
    if isinstance(op, LosePage):
        return epochs.lose_page(state, op.rank, op.page)
    if isinstance(op, Reset):
        return epochs.reset(state)
    if isinstance(op, Detach):
        return epochs.detach(state)
    if isinstance(op, Attach):
        return epochs.attach(state)
    assert isinstance(op, Clear), op
    return epochs.clear(state, op.rank)


def _advance(state: StorageState, op: Advance) -> StorageState:
    thread = state.ranks[op.rank].threads[op.thread]
    # Verify no thread of an ended epoch runs again (INV-24, sglang#36882)
    if thread.epoch != state.epoch:
        state = with_storage_fault(
            state,
            "INV-24",
            f"rank {op.rank}'s {THREADS[op.thread]} thread of epoch {thread.epoch} ran at "
            f"{thread.point} in epoch {state.epoch} (no old-epoch thread after reset)",
        )
        idle = Thread(epoch=state.epoch)
        return with_rank(state, op.rank, with_thread(state.ranks[op.rank], op.thread, idle))
    if op.outcome != "ok":
        state = evolve(state, faults_left=state.faults_left - 1)
    return _ADVANCE[op.thread](state, op)


def run_storage_ops(state: StorageState, ops: Iterable[StorageOp]) -> StorageState:
    """Apply ``ops`` in order; the final state."""
    for op in ops:
        state, _ = storage_step(state, op)
    return state


def all_storage_ops(config: StorageConfig) -> tuple[StorageOp, ...]:
    """Every op the exhaustive checker tries in this world."""
    ops: list[StorageOp] = []
    for index, spec in enumerate(config.ops):
        ops.append(Prefetch(index) if spec.kind == "prefetch" else WriteStorage(index))
    ops += [DrainHits(), DrainAcks(), DrainBackupAcks(), DrainReleases()]
    if config.terminations:
        ops += [Terminate(i) for i, spec in enumerate(config.ops) if spec.kind == "prefetch"]
    for rank in range(config.ranks):
        for thread in range(len(THREADS)):
            ops.append(Advance(rank, thread))
            if not config.max_faults:
                continue
            for (kind, _), outcomes in CALL_OUTCOMES.items():
                if kind != thread:
                    continue
                for outcome in outcomes[1:]:
                    indices = range(config.batch_pages) if outcome in ("hole", "fail") else range(1)
                    ops += [Advance(rank, thread, outcome, i) for i in indices]
    ops += [Collective(group) for group in GROUPS]
    if config.max_faults:
        ops += [LosePage(r, p) for r in range(config.ranks) for p in range(config.pages)]
    if config.max_resets:
        ops.append(Reset())
    if config.detach:
        ops += [Detach(), Attach()]
    if config.clear:
        ops += [Clear(r) for r in range(config.ranks)]
    return tuple(ops)


def enabled_storage_ops(
    state: StorageState, universe: tuple[StorageOp, ...]
) -> tuple[StorageOp, ...]:
    """The ops of ``universe`` enabled in ``state``."""
    return tuple(op for op in universe if why_storage_disabled(state, op) is None)


def thread_ops(state: StorageState, rank: int, thread: int) -> list[StorageOp]:
    """The ``Advance`` ops of one thread enabled in ``state`` (what ``all_storage_ops`` holds
    and ``why_storage_disabled`` admits), built from the thread's point, without a search."""
    if not state.attached:
        return []
    rank_state = state.ranks[rank]
    record = rank_state.threads[thread]
    point = record.point
    if point in ("dead", "reduce"):
        return []
    if point == "idle":
        return [Advance(rank, thread)] if getattr(rank_state, _INPUT[thread]) else []
    ops: list[StorageOp] = [Advance(rank, thread)]
    outcomes = CALL_OUTCOMES.get((thread, point))
    if outcomes is None or state.faults_left <= 0:
        return ops
    for outcome in outcomes[1:]:
        if outcome == "defer" and record.pending:
            continue
        if outcome in ("hole", "fail"):
            width = min(_batch_len(state, rank_state, record), state.config.batch_pages)
            ops += [Advance(rank, thread, outcome, i) for i in range(width)]
        else:
            ops.append(Advance(rank, thread, outcome))
    return ops


def successor_ops(state: StorageState) -> list[StorageOp]:
    """Every op of ``all_storage_ops(state.config)`` enabled in ``state``, built directly (the
    exhaustive checker's hot path; a test holds it equal to filtering the universe)."""
    config = state.config
    first = state.ranks[0]
    ops: list[StorageOp] = []
    if state.attached:
        for index, spec in enumerate(config.ops):
            if spec.kind == "prefetch" and not first.prefetches[index].issued:
                ops.append(Prefetch(index))
            elif spec.kind == "backup" and not first.backups[index].issued:
                ops.append(WriteStorage(index))
    for drain, queue in _DRAINS:
        if tree.drain_count(state, queue):
            ops.append(drain)
    if config.terminations:
        for index, spec in enumerate(config.ops):
            if spec.kind == "prefetch" and all(r.prefetches[index].current for r in state.ranks):
                ops.append(Terminate(index))
    for rank in range(config.ranks):
        for thread in range(len(THREADS)):
            ops += thread_ops(state, rank, thread)
    ops += [Collective(g) for g in GROUPS if collective_rule(state, Collective(g)) is None]
    if state.faults_left > 0:
        for rank, rank_state in enumerate(state.ranks):
            ops += [LosePage(rank, p) for p, tag in enumerate(rank_state.l3) if tag != ABSENT]
    if state.resets_left > 0:
        ops.append(Reset())
    for other in _EPOCH_OPS[: 2 if config.detach else 0] + (
        tuple(Clear(r) for r in range(config.ranks)) if config.clear else ()
    ):
        if why_storage_disabled(state, other) is None:
            ops.append(other)
    return ops


_DRAINS: tuple[tuple[StorageOp, str], ...] = (
    (DrainHits(), "hit_queue"),
    (DrainAcks(), "ack_queue"),
    (DrainBackupAcks(), "backup_acks"),
    (DrainReleases(), "release_queue"),
)
_EPOCH_OPS: tuple[StorageOp, ...] = (Detach(), Attach())
