"""The collectives the storage tier issues, and a rank group that serves them in one process.

SGLang 0.5.23 reduces two numbers across ranks: the hit count of each prefetch (the hit query
thread, group ``prefetch_hits``) and the progress of each batch (the sync thread, group
``prefetch_completion``), both with ``torch.distributed.all_reduce(tensor, op=MIN, group=g)``.
A tier calls ``Collectives.all_reduce`` with the same shape, so an adapter can route upstream's
own calls here too.

- ``SingleRank``: one rank, nothing to reduce (``tp_group=None`` upstream);
- ``RankGroup``: 1-4 ranks in one process. ``view(rank)`` is that rank's handle. Each rank's
  k-th call on a group meets every other rank's k-th call on it (a *rendezvous*); the result is
  the reduction of their contributions. Every collective is logged per rank. A rank that never
  arrives (within ``timeout_s``, or it finished its lockstep step without arriving), or that
  arrives with another op, breaks INV-20: in a real TP group that is a deadlock or a wrong
  answer, here it is an ``InvariantViolation`` and never a hang (sglang#30760 -> #33029).

Lockstep scopes (``begin_step`` / ``rank_finished`` / ``end_step``) are what the manual
executor's multi-rank step uses (``lockstep.py``): within one step every rank must issue the
same collectives in the same order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants.storage_snapshot import CollectiveRecord

COLLECTIVE_TIMEOUT_S_DEFAULT = 5.0
COLLECTIVE_LOG_MAX = 200_000
"""Bound on the per-rank collective log (TigerStyle); older entries go first."""
RANKS_MAX = 8


class ReduceOp(str, Enum):
    MIN = "min"
    MAX = "max"
    SUM = "sum"


def as_reduce_op(op: object) -> ReduceOp:
    """Our ``ReduceOp`` for ours, a name, or ``torch.distributed.ReduceOp.MIN`` and friends."""
    if isinstance(op, ReduceOp):
        return op
    name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    try:
        return ReduceOp(name)
    except ValueError:
        raise HiCacheInputError(
            f"unknown reduce op {op!r}; legal values: {', '.join(o.name for o in ReduceOp)}"
        ) from None


@dataclass(frozen=True)
class SyncGroup:
    """A named group of ranks a collective runs over (upstream creates one gloo group each)."""

    name: str


PREFETCH_HITS = SyncGroup("prefetch_hits")
PREFETCH_COMPLETION = SyncGroup("prefetch_completion")
DEFAULT_GROUP = SyncGroup("default")


class Collectives(Protocol):
    """What a tier needs from its rank group: its rank and an ``all_reduce``."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: object = ReduceOp.SUM, group: SyncGroup | None = None
    ) -> None: ...


class SingleRank:
    """One rank: every reduction is the identity, nothing to wait for."""

    rank = 0
    world_size = 1

    def all_reduce(
        self, tensor: torch.Tensor, op: object = ReduceOp.SUM, group: SyncGroup | None = None
    ) -> None:
        as_reduce_op(op)


def _reduce(op: ReduceOp, values: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    columns = list(zip(*values, strict=True))
    if op is ReduceOp.MIN:
        return tuple(min(c) for c in columns)
    if op is ReduceOp.MAX:
        return tuple(max(c) for c in columns)
    return tuple(sum(c) for c in columns)


@dataclass
class _Rendezvous:
    group: str
    seq: int
    contributions: dict[int, tuple[ReduceOp, tuple[int, ...]]] = field(default_factory=dict)
    collected: set[int] = field(default_factory=set)
    result: tuple[int, ...] | None = None
    broken: InvariantViolation | None = None
    interrupted: bool = False


class StorageInterrupted(RuntimeError):
    """A collective was abandoned because its tier is stopping (reset or detach)."""


class RankGroup:
    """``world_size`` ranks in one process, served through per-rank views."""

    def __init__(self, world_size: int, *, timeout_s: float = COLLECTIVE_TIMEOUT_S_DEFAULT) -> None:
        if not 1 <= world_size <= RANKS_MAX:
            raise HiCacheInputError(f"a rank group has 1..{RANKS_MAX} ranks, got {world_size}")
        if timeout_s <= 0:
            raise HiCacheInputError(f"timeout_s must be positive, got {timeout_s}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._rendezvous: dict[tuple[str, int], _Rendezvous] = {}
        self._seq: list[dict[str, int]] = [{} for _ in range(world_size)]
        self._logs: list[list[CollectiveRecord]] = [[] for _ in range(world_size)]
        self._step: int | None = None
        self._steps_run = 0
        self._finished: set[int] = set()
        self._step_start: list[int] = [0] * world_size
        self._interrupted = False
        self.violations: list[InvariantViolation] = []
        self.attachments: dict[str, object] = {}
        """What a layer above keeps per group (a PP world's command-group broadcast)."""

    def view(self, rank: int) -> RankCollectives:
        if not 0 <= rank < self.world_size:
            raise HiCacheInputError(f"rank {rank} is outside [0, {self.world_size})")
        return RankCollectives(self, rank)

    # -- the log -----------------------------------------------------------------------------------
    def log(self, rank: int) -> tuple[CollectiveRecord, ...]:
        with self._cond:
            return tuple(self._logs[rank])

    def logs(self) -> tuple[tuple[CollectiveRecord, ...], ...]:
        with self._cond:
            return tuple(tuple(log) for log in self._logs)

    def _fail(self, message: str) -> InvariantViolation:
        violation = InvariantViolation("INV-20", message)
        self.violations.append(violation)
        return violation

    # -- all_reduce --------------------------------------------------------------------------------
    def all_reduce(self, rank: int, tensor: torch.Tensor, op: object, group: SyncGroup) -> None:
        """Rank ``rank``'s part of one reduction; writes the result into ``tensor``. A gated
        storage thread of a harness world with schedule points parks first (its
        ``park_at_point``; the harness grants a collective on every rank at once)."""
        park = getattr(threading.current_thread(), "park_at_point", None)
        if park is not None:
            park("all_reduce", group.name)
        reduce_op = as_reduce_op(op)
        values = tuple(int(v) for v in tensor.reshape(-1).tolist())
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            if self._interrupted:
                raise StorageInterrupted(f"rank {rank}: {group.name} collective while stopping")
            seq = self._seq[rank].get(group.name, 0)
            self._seq[rank][group.name] = seq + 1
            meeting = self._rendezvous.setdefault((group.name, seq), _Rendezvous(group.name, seq))
            meeting.contributions[rank] = (reduce_op, values)
            self._complete_if_all_arrived(meeting)
            self._cond.notify_all()
            while meeting.result is None and meeting.broken is None and not meeting.interrupted:
                self._check_partners(meeting, rank, deadline)
                if meeting.result is None and meeting.broken is None and not meeting.interrupted:
                    self._cond.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            if meeting.interrupted:
                raise StorageInterrupted(f"rank {rank}: {group.name} collective #{seq} abandoned")
            if meeting.broken is not None:
                raise meeting.broken
            result = meeting.result
            assert result is not None
            self._append_log(
                CollectiveRecord(rank, group.name, seq, reduce_op.value, values, result, self._step)
            )
            meeting.collected.add(rank)
            if len(meeting.collected) == self.world_size:
                del self._rendezvous[(group.name, seq)]
        tensor.copy_(torch.tensor(result, dtype=tensor.dtype).reshape(tensor.shape))

    def _append_log(self, record: CollectiveRecord) -> None:
        log = self._logs[record.rank]
        if len(log) >= COLLECTIVE_LOG_MAX:
            del log[0]
        log.append(record)

    def _complete_if_all_arrived(self, meeting: _Rendezvous) -> None:
        if len(meeting.contributions) < self.world_size:
            return
        ops = {op for op, _ in meeting.contributions.values()}
        widths = {len(v) for _, v in meeting.contributions.values()}
        # Verify every rank reduces with the same op and shape (a mismatch is a wrong answer)
        if len(ops) > 1 or len(widths) > 1:
            detail = {r: (op.name, len(v)) for r, (op, v) in sorted(meeting.contributions.items())}
            meeting.broken = self._fail(
                f"collective #{meeting.seq} of group {meeting.group} mixes ops or shapes across "
                f"ranks {detail} (every rank must issue the same collective)"
            )
            return
        ordered = [meeting.contributions[r][1] for r in range(self.world_size)]
        meeting.result = _reduce(next(iter(ops)), ordered)

    def _check_partners(self, meeting: _Rendezvous, rank: int, deadline: float) -> None:
        missing = sorted(set(range(self.world_size)) - set(meeting.contributions))
        if self._interrupted:
            meeting.interrupted = True
            return
        # Verify no partner already finished its lockstep step without this collective
        gone = [r for r in missing if r in self._finished]
        if gone:
            meeting.broken = self._fail(
                f"rank {rank} issued collective #{meeting.seq} of group {meeting.group} in "
                f"lockstep step {self._step}, but rank(s) {gone} finished that step without it "
                "(a collective whose count depends on rank-local state; sglang#30760)"
            )
            return
        if time.monotonic() >= deadline:
            meeting.broken = self._fail(
                f"deadlock: rank(s) {missing} never joined collective #{meeting.seq} of group "
                f"{meeting.group} that rank {rank} issued, within {self.timeout_s:g} s (every "
                "rank must issue the same collectives in the same order)"
            )

    # -- lockstep steps ----------------------------------------------------------------------------
    def begin_step(self) -> int:
        """Open one lockstep step (every rank runs the same thread's step); returns its index."""
        with self._cond:
            if self._step is not None:
                raise HiCacheInputError(f"lockstep step {self._step} is still open")
            self._step = self._steps_run
            self._steps_run += 1
            self._finished.clear()
            self._step_start = [len(log) for log in self._logs]
            return self._step

    def rank_finished(self, rank: int) -> None:
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()

    def end_step(self) -> None:
        """Close the step; raise INV-20 unless every rank issued the same collectives in order."""
        with self._cond:
            step = self._step
            self._step = None
            issued = [
                [(r.group, r.op) for r in log[start:]]
                for log, start in zip(self._logs, self._step_start, strict=True)
            ]
            self._finished.clear()
        # Verify the same collectives, in the same order, on every rank
        if any(calls != issued[0] for calls in issued[1:]):
            detail = {rank: [f"{g}:{op}" for g, op in calls] for rank, calls in enumerate(issued)}
            raise self._fail(
                f"lockstep step {step}: ranks issued different collectives {detail} (every rank "
                "must issue the same collectives in the same order per step)"
            )

    # -- stopping ----------------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Abandon every waiting collective (a stop across all ranks); refuse new ones."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Serve collectives again after ``interrupt``; every rank starts a fresh sequence."""
        with self._cond:
            self._interrupted = False
            self._rendezvous.clear()
            self._seq = [{} for _ in range(self.world_size)]


class RankCollectives:
    """One rank's handle on a ``RankGroup`` (what one rank's tier holds)."""

    def __init__(self, group: RankGroup, rank: int) -> None:
        self.group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce(
        self, tensor: torch.Tensor, op: object = ReduceOp.SUM, group: SyncGroup | None = None
    ) -> None:
        self.group.all_reduce(self._rank, tensor, op, group or DEFAULT_GROUP)
