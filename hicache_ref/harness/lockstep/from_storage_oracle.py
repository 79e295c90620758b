"""Replay a storage oracle trace on an implementation: its ops as harness steps under points.

``formal/bounded_storage`` returns the shortest op trace that breaks an invariant of a planted
protocol variant. ``storage_trace_for(config, ops)`` turns it into a harness trace in a world
with schedule points, so the same interleaving runs against a real tier (the reference's, a
mutant's, upstream's): a tier that carries the planted bug must fail it, the reference pass it.

One rank, one chain per operation. The world's L3 content (``config.preloaded``: every page of
the chain, or none) is a backup run to its end and drained before the trace's own steps. Per op:

| oracle | harness |
| --- | --- |
| ``WriteStorage`` / ``Prefetch`` | ``write_storage`` (a chain of the op's pages) / ``prefetch`` |
| ``Advance`` ``ok`` / ``hole`` / ``raise`` / ``defer`` / ``fail`` | ``storage_step`` / ``schedule_point`` (``hole`` at the index; ``fail``: ``hole``) |
| the IO's termination ``check`` right after its ``get`` | nothing: the harness's ``wait`` grant runs both |
| ``Collective`` | ``storage_step`` of the group's thread (its ``all_reduce``) |
| ``DrainHits`` / ``DrainAcks``, ``DrainBackupAcks`` / ``DrainReleases`` | ``drain_prefetch_acks``, ``drain_backup_acks`` |
| ``Terminate`` / ``Reset`` | ``terminate_prefetch`` / ``reset_storage_in_flight`` |

The points are the reference tier's (and its mutants'); upstream 0.5.23's backup thread parks
at the same points, its hit query at fewer (one ``batch_exists`` per chain), so a trace through
the hit query takes other grants there. Where the harness cannot take the same interleaving (two ranks, a drain that would also take
the other queue, an op between the IO's ``get`` and its check, a lost page, an epoch op), the
translation raises ``UntranslatableStorageTrace`` naming the op.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.rules import storage as rules
from hicache_ref.harness.rules.schedule import SCHEDULE_POINT
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.oracle.storage import (
    IO,
    THREADS,
    Advance,
    Collective,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
    Prefetch,
    Reset,
    StorageConfig,
    StorageOp,
    Terminate,
    WriteStorage,
    initial_storage_state,
    storage_step,
)
from hicache_ref.oracle.storage.state import GROUP_THREAD


class UntranslatableStorageTrace(HiCacheInputError):
    """An oracle op the harness cannot take in the same interleaving."""


def harness_config_for_storage(config: StorageConfig) -> HarnessConfig:
    return HarnessConfig(
        host_pages=24,
        storage_ranks=config.ranks,
        storage_batch_pages=config.batch_pages,
        storage_points=True,
        seed=0,
    )


def storage_steps_for_ops(config: StorageConfig, ops: Sequence[StorageOp]) -> list[Step]:
    """The harness steps of ``ops`` (after the setup that puts ``config.preloaded`` in L3)."""
    if config.ranks != 1 or len({spec.pages for spec in config.ops}) > 1:
        raise UntranslatableStorageTrace(
            f"storage traces translate for one rank and one chain length; this world has "
            f"{config.ranks} rank(s) and ops of {sorted({s.pages for s in config.ops})} pages"
        )
    pages = config.ops[0].pages if config.ops else config.pages
    steps = _setup(config, pages)
    state = initial_storage_state(config)
    rids: dict[int, str] = {}
    io_got = False  # the previous op was the IO's get on its input queue
    for index, op in enumerate(ops):
        steps += _translate(state, op, io_got, pages, rids, index)
        io_got = isinstance(op, Advance) and op.thread == IO
        io_got = io_got and state.ranks[0].threads[IO].point == "idle"
        state, _ = storage_step(state, op)
    return steps


def storage_trace_for(
    config: StorageConfig, ops: Sequence[StorageOp], implementation: str = "reference"
) -> Trace:
    header = TraceHeader(
        implementation=implementation,
        config=harness_config_for_storage(config),
        note=f"storage oracle trace of {len(ops)} ops",
    )
    return Trace(header=header, steps=tuple(storage_steps_for_ops(config, ops)))


def _setup(config: StorageConfig, pages: int) -> list[Step]:
    preloaded = config.preloaded[0] if config.preloaded else 0
    if preloaded == 0:
        return []
    if preloaded != pages:
        raise UntranslatableStorageTrace(
            f"L3 preloaded with {preloaded} of a chain's {pages} pages (a whole chain or none)"
        )
    backup = _write(pages)
    grants = [_grant("backup")] * (2 + _batches(pages, config.batch_pages))  # wait, sets, put
    return [backup, *grants, Step(rule=rules.DRAIN_BACKUP_ACKS.name)]


def _batches(pages: int, batch: int) -> int:
    return (pages + batch - 1) // batch


def _write(pages: int) -> Step:
    return Step(rule=rules.WRITE_STORAGE.name, args={"pick": pages - 1, "new": True})


def _grant(kind: str) -> Step:
    return Step(rule=rules.STORAGE_STEP.name, args={"kind": kind})


def _translate(
    state: object,
    op: StorageOp,
    io_got: bool,
    pages: int,
    rids: dict[int, str],
    index: int,
) -> list[Step]:
    from hicache_ref.oracle.storage import StorageState

    assert isinstance(state, StorageState)
    rank = state.ranks[0]
    where = f"op {index} ({op})"
    if isinstance(op, WriteStorage):
        return [_write(pages)]
    if isinstance(op, Prefetch):
        rids[op.op] = f"q{len(rids)}"
        return [Step(rule=rules.PREFETCH.name, args={"pick": 0})]
    if isinstance(op, Advance):
        thread = rank.threads[op.thread]
        kind = THREADS[op.thread]
        if op.thread == IO and thread.point == "check" and thread.batch == 0:
            if io_got:
                return []  # the harness's wait grant ran the check with the get
            raise UntranslatableStorageTrace(f"{where}: the IO's check apart from its get")
        if thread.pending and op.outcome != "ok":
            raise UntranslatableStorageTrace(f"{where}: a deferred read's outcome at its return")
        if op.outcome == "ok":
            return [_grant(kind)]
        outcome = "hole" if op.outcome == "fail" else op.outcome
        args = {"thread": kind, "outcome": outcome, "rank": 0, "at": op.index}
        return [Step(rule=SCHEDULE_POINT.name, args=args)]  # type: ignore[arg-type]
    if isinstance(op, Collective):
        return [_grant(THREADS[GROUP_THREAD[op.group]])]
    if isinstance(op, DrainHits | DrainAcks):
        other = rank.ack_queue if isinstance(op, DrainHits) else rank.hit_queue
        if other:
            raise UntranslatableStorageTrace(f"{where}: drain_prefetch_acks drains both queues")
        return [Step(rule=rules.DRAIN_PREFETCH_ACKS.name)]
    if isinstance(op, DrainBackupAcks | DrainReleases):
        if isinstance(op, DrainReleases) and rank.backup_acks:
            raise UntranslatableStorageTrace(f"{where}: drain_backup_acks drains acks first")
        return [Step(rule=rules.DRAIN_BACKUP_ACKS.name)]
    if isinstance(op, Terminate):
        return [Step(rule=rules.TERMINATE_PREFETCH.name, args={"request": rids[op.op]})]
    if isinstance(op, Reset):
        return [Step(rule=rules.RESET_STORAGE_IN_FLIGHT.name)]
    raise UntranslatableStorageTrace(f"{where}: no harness step takes it")
