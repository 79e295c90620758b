"""Compound storage stories for the schedules (``programs.py`` turns them into programs).

- ``run_storage_round_trip``: maybe a fault armed -> ``write_storage`` -> its backup steps ->
  ``drain_backup_acks`` -> ``prefetch`` -> storage steps of every runnable thread with drains
  between them -> an end (a policy check, a termination, a detach) -> maybe a load of what the
  prefetch inserted (L3 -> host -> device: the tree's byte checks then read it). Under schedule
  points (``storage_points``) the drawn fault is the outcome of one backend call of the story
  (``CALL_FAULTS``: the thread parked at it is granted through ``schedule_point``), and the
  end lands while the prefetch's IO thread is parked between two of its batches
  (``io_between_batches``), so a termination, a detach or a policy verdict meets an IO with
  more to read;
- ``run_storage_steps``: a few steps of whatever storage thread can run, with drains.

Steps name their rules through the records (``rules/storage.py``, ``rules/load.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.rules.record import (
    PICK,
    Bools,
    Ints,
    OneOf,
    Param,
    RuleRecord,
    StepContext,
)
from hicache_ref.harness.rules.schedule import SCHEDULE_POINT
from hicache_ref.harness.rules.storage import (
    ARMABLE_FAULTS,
    CHECK_PREFETCH,
    DETACH_STORAGE,
    DRAIN_BACKUP_ACKS,
    DRAIN_PREFETCH_ACKS,
    INJECT_FAULT,
    PREFETCH,
    STORAGE_STEP,
    TERMINATE_PREFETCH,
    WRITE_STORAGE,
    driver,
)
from hicache_ref.harness.schedule.points import HOLE, RAISE, SHORT, WAIT, face, position
from hicache_ref.harness.step_types import StepArg
from hicache_ref.harness.steps.trace import Step

BACKUP_STEPS_MAX = 8
POINT_STEPS_FACTOR = 3
"""Under schedule points a loop body takes about three grants (a call, a put, the wait), so a
round trip draws that many more storage steps to reach the same depth (mid-transfer ends)."""
END_AT_MAX = 3
"""Under points the round trip's end lands the 1st to 3rd time (from ``steps``) the prefetch's IO
thread is seen parked between two of its batches: a termination, a detach or a policy check
then meets an IO that has more batches to read (sglang#16747, #31296's window)."""
CALL_FAULTS: dict[str, tuple[tuple[StorageStepKind, ...], str]] = {
    "exists_miss": ((StorageStepKind.HIT_QUERY,), HOLE),
    "get_fail": ((StorageStepKind.IO,), HOLE),
    "short_read": ((StorageStepKind.IO,), SHORT),
    "set_fail": ((StorageStepKind.BACKUP,), HOLE),
    "raise": ((StorageStepKind.IO, StorageStepKind.BACKUP), RAISE),
}
"""Under points, a drawn fault -> the threads whose backend call it may hit (one, picked by
``pick``) and the outcome that call gets. ``set_drop`` (a write that reports success and stores
nothing) has no per-call outcome and stays an armed fault."""
ENDS = ("none", "none", "none", "check", "check", "terminate", "detach")


def _step(record: RuleRecord, **args: StepArg) -> Step:
    return Step(rule=record.name, args=dict(args))


def storage_attached(session: StepContext) -> bool:
    d = driver(session)
    return d is not None and d.attached


def storage_runnable(session: StepContext) -> bool:
    d = driver(session)
    return d is not None and d.attached and bool(d.runnable())


def io_between_batches(session: StepContext) -> bool:
    """Under schedule points: rank 0's IO thread is parked inside its loop body after it read
    a batch of the prefetch it works on (so a later batch is still to come, or its acks)."""
    d = driver(session)
    if d is None or d.points is None or not d.attached:
        return False
    tier = d.l3.tiers[0]
    at = position(tier, StorageStepKind.IO)
    if at is None or at.kind == WAIT:
        return False
    rid = face(tier).current_request(StorageStepKind.IO)
    return rid is not None and (0, rid) in d.log.read_started


class CallFault:
    """The one backend call of a round trip that gets a drawn outcome (under points)."""

    def __init__(self, fault: str, rank: int, pick: int) -> None:
        kinds, self.outcome = CALL_FAULTS[fault]
        self.kind = kinds[pick % len(kinds)]
        self.rank, self.at = rank, 0  # its first key, as an armed fault hits the first page
        self.spent = False

    def step(self, session: StepContext, kind: StorageStepKind) -> Step | None:
        """The grant of ``kind`` with the outcome, if its thread waits at a backend call now."""
        if self.spent or kind is not self.kind:
            return None
        args: dict[str, StepArg] = {
            "thread": kind.value,
            "outcome": self.outcome,
            "rank": self.rank,
            "at": self.at,
        }
        if SCHEDULE_POINT.why_not(session, args) is not None:
            return None  # not parked at a backend call (yet): an ordinary step
        self.spent = True
        return Step(rule=SCHEDULE_POINT.name, args=args)


def _grant(session: StepContext, kind: StorageStepKind, call: CallFault | None) -> Step:
    got = call.step(session, kind) if call is not None else None
    return got or _step(STORAGE_STEP, kind=kind.value)


def _steps(
    session: StepContext,
    count: int,
    pick: int,
    end_at: int = 0,
    call: CallFault | None = None,
) -> Iterator[Step]:
    """``count`` steps of the runnable threads, in turn from ``pick``; with ``end_at``, they
    stop the ``end_at``-th time the IO thread is seen parked between two of its batches."""
    d = driver(session)
    assert d is not None
    seen = 0
    for i in range(count):
        runnable = d.runnable() if d.attached else []
        if not runnable:
            return
        yield _grant(session, runnable[(pick + i) % len(runnable)], call)
        if end_at and io_between_batches(session):
            seen += 1
            if seen >= end_at:
                return
        if i % 2:
            yield _step(DRAIN_PREFETCH_ACKS)


def run_storage_steps(session: StepContext, p: Mapping[str, Any]) -> Iterator[Step]:
    yield from _steps(session, int(p["steps"]), int(p["pick"]))
    yield _step(DRAIN_PREFETCH_ACKS)


def run_storage_round_trip(
    session: StepContext, p: Mapping[str, Any], load_rule: RuleRecord, start_loading: RuleRecord
) -> Iterator[Step]:
    d = driver(session)
    assert d is not None
    pick = int(p["pick"])
    fault, rank = str(p["fault"]), int(p["fault_rank"])
    points = d.points is not None and fault in CALL_FAULTS
    call = CallFault(fault, rank % d.n, pick) if points else None
    if fault != "none" and call is None:
        yield _step(INJECT_FAULT, fault=fault, rank=rank, pages=1)
    yield _step(WRITE_STORAGE, pick=pick, new=bool(p["new"]))
    for _ in range(BACKUP_STEPS_MAX):
        if not d.attached or StorageStepKind.BACKUP not in d.runnable():
            break
        yield _grant(session, StorageStepKind.BACKUP, call)
    yield _step(DRAIN_BACKUP_ACKS)
    if d.attached and d.prefetch_candidates():
        yield _step(PREFETCH, pick=pick)
    end = str(p["end"])
    scale, end_at = 1, 0
    if d.points is not None:
        scale = POINT_STEPS_FACTOR
        if end != "none":  # the end lands inside the IO's loop body, between two batches
            end_at = 1 + int(p["steps"]) % END_AT_MAX
    yield from _steps(session, int(p["steps"]) * scale, pick, end_at, call)
    yield _step(DRAIN_PREFETCH_ACKS)
    ongoing = d.ongoing()
    if end == "check" and ongoing:
        yield _step(CHECK_PREFETCH, request=ongoing[pick % len(ongoing)])
    elif end == "terminate" and ongoing:
        yield _step(TERMINATE_PREFETCH, request=ongoing[pick % len(ongoing)])
    elif end == "detach" and d.attached:
        yield _step(DETACH_STORAGE)
    if bool(p["load_back"]):
        loadable = [uid for uid in d.chains if uid in session.candidates(load_rule.name)]
        if loadable:
            yield _step(load_rule, node=loadable[pick % len(loadable)])
            yield _step(start_loading)


STORAGE_ROUND_TRIP_PARAMS: dict[str, Param] = {
    "pick": PICK,
    "new": Bools(),
    "steps": Ints(2, 12),
    "fault": OneOf(("none", "none", "none", *ARMABLE_FAULTS)),
    "fault_rank": Ints(0, 3),
    "end": OneOf(ENDS),
    "load_back": Bools(),
}
STORAGE_STEPS_PARAMS: dict[str, Param] = {"steps": Ints(1, 8), "pick": PICK}
