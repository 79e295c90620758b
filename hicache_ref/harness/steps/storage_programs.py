"""Compound storage stories for the schedules (``programs.py`` turns them into programs).

- ``run_storage_round_trip``: maybe a fault armed -> ``write_storage`` -> its backup steps ->
  ``drain_backup_acks`` -> ``prefetch`` -> storage steps of every runnable thread with drains
  between them -> an end (a policy check, a termination, a detach) -> maybe a load of what the
  prefetch inserted (L3 -> host -> device: the tree's byte checks then read it);
- ``run_storage_steps``: a few steps of whatever storage thread can run, with drains.

Steps name their rules through the records (``rules/storage.py``, ``rules/load.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hicache_ref.harness.rules.record import (
    PICK,
    Bools,
    Ints,
    OneOf,
    Param,
    RuleRecord,
    StepContext,
)
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
from hicache_ref.harness.step_types import StepArg
from hicache_ref.harness.steps.trace import Step

BACKUP_STEPS_MAX = 8
POINT_STEPS_FACTOR = 3
"""Under schedule points a loop body takes about three grants (a call, a put, the wait), so a
round trip draws that many more storage steps to reach the same depth (mid-transfer ends)."""
ENDS = ("none", "none", "none", "check", "check", "terminate", "detach")


def _step(record: RuleRecord, **args: StepArg) -> Step:
    return Step(rule=record.name, args=dict(args))


def storage_attached(session: StepContext) -> bool:
    d = driver(session)
    return d is not None and d.attached


def storage_runnable(session: StepContext) -> bool:
    d = driver(session)
    return d is not None and d.attached and bool(d.runnable())


def _steps(session: StepContext, count: int, pick: int) -> Iterator[Step]:
    d = driver(session)
    assert d is not None
    for i in range(count):
        runnable = d.runnable() if d.attached else []
        if not runnable:
            return
        yield _step(STORAGE_STEP, kind=runnable[(pick + i) % len(runnable)].value)
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
    if p["fault"] != "none":
        yield _step(INJECT_FAULT, fault=str(p["fault"]), rank=int(p["fault_rank"]), pages=1)
    yield _step(WRITE_STORAGE, pick=pick, new=bool(p["new"]))
    for _ in range(BACKUP_STEPS_MAX):
        if not d.attached or not any(k.value == "backup" for k in d.runnable()):
            break
        yield _step(STORAGE_STEP, kind="backup")
    yield _step(DRAIN_BACKUP_ACKS)
    if d.attached and d.prefetch_candidates():
        yield _step(PREFETCH, pick=pick)
    scale = POINT_STEPS_FACTOR if d.points is not None else 1
    yield from _steps(session, int(p["steps"]) * scale, pick)
    yield _step(DRAIN_PREFETCH_ACKS)
    ongoing = d.ongoing()
    end = str(p["end"])
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
