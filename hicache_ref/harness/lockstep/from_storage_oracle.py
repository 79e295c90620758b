"""Replay a storage oracle trace on an implementation: its ops as harness steps under points.

``formal/bounded_storage`` returns the shortest op trace that breaks an invariant of a planted
protocol variant. ``storage_trace_for(config, ops)`` turns it into a harness trace in a world
with schedule points, so the same interleaving runs against a real tier (the reference's, a
mutant's, upstream's): a tier that carries the planted bug must fail it, the reference pass it.

One chain per operation, on one rank or several. A harness grant moves every rank's thread of
one kind that can move (the outcome drawn for one rank, ``ok`` elsewhere), while the oracle
advances one rank's thread per op; so ``harness_shaped`` first regroups the trace: an
``Advance`` of one rank's thread takes with it that thread's next ``Advance`` on every other
rank that can move then (pulled forward; an ``ok`` one added where the trace has none), at most
one of them with another outcome than ``ok``. The regrouped trace is an interleaving of the
same world, not always the same one: ``storage_trace_for`` translates it, and a caller that
needs its verdict replays it on the oracle (``run_storage_ops``). The world's L3 content
(``config.preloaded``: every page of the chain on every rank, or none) is a backup run to its
end and drained before the trace's own steps. Per op:

| oracle | harness |
| --- | --- |
| ``WriteStorage`` / ``Prefetch`` | ``write_storage`` (a chain of the op's pages) / ``prefetch`` |
| a group of ``Advance`` (one per rank that moves) ``ok`` / ``hole`` / ``raise`` / ``defer`` / ``fail`` | ``storage_step`` / ``schedule_point`` on the rank of the outcome (``hole`` at the index; ``fail``: ``hole``) |
| the IO's termination ``check`` right after its ``get`` | nothing: the harness's ``wait`` grant runs both |
| ``Collective`` | ``storage_step`` of the group's thread (its ``all_reduce``) |
| ``DrainHits`` / ``DrainAcks``, ``DrainBackupAcks`` / ``DrainReleases`` | ``drain_prefetch_acks``, ``drain_backup_acks`` |
| ``Terminate`` / ``Reset`` | ``terminate_prefetch`` / ``reset_storage_in_flight`` |
| ``Clear`` / ``Detach`` / ``Attach`` | ``clear_storage`` (the rank's) / ``detach_storage`` / ``attach_storage`` |

The points are the reference tier's (and its mutants'); upstream 0.5.23's backup thread parks
at the same points, its hit query at fewer (one ``batch_exists`` per chain), so a trace through
the hit query takes other grants there. Where the harness cannot take the same interleaving (two
outcomes in one grant, ranks whose L3 differs, a drain that would also take the other queue, an
op between the IO's ``get`` and its check, a lost page, an epoch op), the
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
    Attach,
    Clear,
    Collective,
    Detach,
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


def harness_shaped(config: StorageConfig, ops: Sequence[StorageOp]) -> tuple[StorageOp, ...]:
    """``ops`` regrouped as the harness grants (see the module docstring): each ``Advance`` is
    followed at once by the same thread's ``Advance`` on every other rank that can move then."""
    if config.ranks == 1:
        return tuple(ops)
    state = initial_storage_state(config)
    rest = list(ops)
    shaped: list[StorageOp] = []
    while rest:
        op = rest.pop(0)
        group = [op]
        if isinstance(op, Advance):
            group += _pull_peers(state, op, rest)
        if sum(1 for o in group if isinstance(o, Advance) and o.outcome != "ok") > 1:
            raise UntranslatableStorageTrace(
                f"{op}: two ranks' calls with outcomes in one grant (the harness draws one)"
            )
        for each in group:
            state, _ = storage_step(state, each)
        shaped += group
    return tuple(shaped)


def _pull_peers(state: object, op: Advance, rest: list[StorageOp]) -> list[StorageOp]:
    """The ``op.thread`` advances of the other ranks that can move in ``state``: each one's
    next in ``rest`` (taken out of it), or an ``ok`` one."""
    from hicache_ref.oracle.storage import StorageState
    from hicache_ref.oracle.storage.step import thread_ops

    assert isinstance(state, StorageState)
    peers: list[StorageOp] = []
    for rank in range(len(state.ranks)):
        if rank == op.rank or not thread_ops(state, rank, op.thread):
            continue
        later = next(
            (
                i
                for i, o in enumerate(rest)
                if isinstance(o, Advance) and (o.rank, o.thread) == (rank, op.thread)
            ),
            None,
        )
        peers.append(Advance(rank, op.thread) if later is None else rest.pop(later))
    return peers


def storage_steps_for_ops(config: StorageConfig, ops: Sequence[StorageOp]) -> list[Step]:
    """The harness steps of ``ops``, harness-shaped already on several ranks (after the setup
    that puts ``config.preloaded`` in L3)."""
    if len({spec.pages for spec in config.ops}) > 1:
        raise UntranslatableStorageTrace(
            f"storage traces translate for one chain length; this world has ops of "
            f"{sorted({s.pages for s in config.ops})} pages"
        )
    pages = config.ops[0].pages if config.ops else config.pages
    steps = _setup(config, pages)
    state = initial_storage_state(config)
    rids: dict[int, str] = {}
    io_got = False  # the previous grant was the IO's get on its input queue
    index = 0
    while index < len(ops):
        op = ops[index]
        group = [op]
        if isinstance(op, Advance):  # one grant: this thread on every rank that moves
            while index + len(group) < len(ops):
                peer = ops[index + len(group)]
                if not isinstance(peer, Advance) or peer.thread != op.thread:
                    break
                if peer.rank in {o.rank for o in group if isinstance(o, Advance)}:
                    break
                group.append(peer)
        steps += _translate(state, group, io_got, pages, rids, index)
        io_got = isinstance(op, Advance) and op.thread == IO
        io_got = io_got and all(
            state.ranks[o.rank].threads[IO].point == "idle" for o in group if isinstance(o, Advance)
        )
        for each in group:
            state, _ = storage_step(state, each)
        index += len(group)
    return steps


def storage_trace_for(
    config: StorageConfig, ops: Sequence[StorageOp], implementation: str = "reference"
) -> Trace:
    header = TraceHeader(
        implementation=implementation,
        config=harness_config_for_storage(config),
        note=f"storage oracle trace of {len(ops)} ops",
    )
    steps = storage_steps_for_ops(config, harness_shaped(config, ops))
    return Trace(header=header, steps=tuple(steps))


def _setup(config: StorageConfig, pages: int) -> list[Step]:
    preloaded = config.preloaded[0] if config.preloaded else 0
    if len(set(config.preloaded)) > 1:
        raise UntranslatableStorageTrace(
            f"L3 preloaded unlike on each rank {config.preloaded} (a backup writes every rank's)"
        )
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
    group: Sequence[StorageOp],
    io_got: bool,
    pages: int,
    rids: dict[int, str],
    index: int,
) -> list[Step]:
    from hicache_ref.oracle.storage import StorageState

    assert isinstance(state, StorageState)
    op = group[0]
    ranks = state.ranks
    where = f"op {index} ({op})"
    if isinstance(op, WriteStorage):
        return [_write(pages)]
    if isinstance(op, Prefetch):
        rids[op.op] = f"q{len(rids)}"
        return [Step(rule=rules.PREFETCH.name, args={"pick": 0})]
    if isinstance(op, Advance):
        advances = [o for o in group if isinstance(o, Advance)]
        threads = [ranks[o.rank].threads[o.thread] for o in advances]
        kind = THREADS[op.thread]
        if op.thread == IO and all(t.point == "check" and t.batch == 0 for t in threads):
            if io_got:
                return []  # the harness's wait grant ran the check with the get
            raise UntranslatableStorageTrace(f"{where}: the IO's check apart from its get")
        drawn = [o for o in advances if o.outcome != "ok"]
        if not drawn:
            return [_grant(kind)]
        pick = drawn[0]
        if ranks[pick.rank].threads[pick.thread].pending:
            raise UntranslatableStorageTrace(f"{where}: a deferred read's outcome at its return")
        outcome = "hole" if pick.outcome == "fail" else pick.outcome
        args = {"thread": kind, "outcome": outcome, "rank": pick.rank, "at": pick.index}
        return [Step(rule=SCHEDULE_POINT.name, args=args)]  # type: ignore[arg-type]
    if isinstance(op, Collective):
        return [_grant(THREADS[GROUP_THREAD[op.group]])]
    if isinstance(op, DrainHits | DrainAcks):
        other = any(r.ack_queue if isinstance(op, DrainHits) else r.hit_queue for r in ranks)
        if other:
            raise UntranslatableStorageTrace(f"{where}: drain_prefetch_acks drains both queues")
        return [Step(rule=rules.DRAIN_PREFETCH_ACKS.name)]
    if isinstance(op, DrainBackupAcks | DrainReleases):
        if isinstance(op, DrainReleases) and any(r.backup_acks for r in ranks):
            raise UntranslatableStorageTrace(f"{where}: drain_backup_acks drains acks first")
        return [Step(rule=rules.DRAIN_BACKUP_ACKS.name)]
    if isinstance(op, Terminate):
        return [Step(rule=rules.TERMINATE_PREFETCH.name, args={"request": rids[op.op]})]
    if isinstance(op, Reset):
        return [Step(rule=rules.RESET_STORAGE_IN_FLIGHT.name)]
    if isinstance(op, Clear):
        return [Step(rule=rules.CLEAR_STORAGE.name, args={"rank": op.rank})]
    if isinstance(op, Detach):
        return [Step(rule=rules.DETACH_STORAGE.name)]
    if isinstance(op, Attach):
        return [Step(rule=rules.ATTACH_STORAGE.name)]
    raise UntranslatableStorageTrace(f"{where}: no harness step takes it")
