"""Seeded random walks over the storage rules: what the storage lockstep's tests and its
benchmark (``benchmarks/bench_storage_lockstep.py``) drive, without Hypothesis.

``storage_case(seed, points)`` is one world (1, 2 or 4 ranks; batches of 1 or 2 pages; each
prefetch policy; injected faults; with ``points``, schedule points: a storage step then runs a
thread to its next point) and ``walk_step(session, rng)`` one step drawn among the storage rules
(storage steps weighted first; under points also ``schedule_point``, a backend call's drawn
outcome) with arguments the world can take, retried a few times for one the rules' discipline
allows now. ``run_walk`` applies ``steps`` of them and settles the case.
"""

from __future__ import annotations

import random

from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.rules import RULES as RULES_BY_NAME
from hicache_ref.harness.rules import storage as rules
from hicache_ref.harness.rules.schedule import SCHEDULE_POINT
from hicache_ref.harness.schedule.points import AT_MAX, BACKEND_POINTS, OUTCOMES, position
from hicache_ref.harness.step_types import RuleName, StepArg
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.storage.fault_injection import FAULT_KINDS

WALK_RULES: tuple[RuleName, ...] = tuple(
    record.name
    for record in (
        (rules.STORAGE_STEP,) * 10
        + (rules.WRITE_STORAGE, rules.PREFETCH) * 3
        + (rules.DRAIN_PREFETCH_ACKS, rules.DRAIN_BACKUP_ACKS) * 2
        + (rules.TERMINATE_PREFETCH, rules.CHECK_PREFETCH, rules.INJECT_FAULT,
           rules.RESET_STORAGE_IN_FLIGHT, rules.DETACH_STORAGE, rules.ATTACH_STORAGE,
           rules.CLEAR_STORAGE)
    )
)  # fmt: skip
"""The rules a walk draws from, weighted (storage steps first)."""
POINT_RULES: tuple[RuleName, ...] = tuple(
    record.name
    for record in (
        (rules.STORAGE_STEP,) * 24
        + (SCHEDULE_POINT,) * 12
        + (rules.WRITE_STORAGE, rules.PREFETCH, rules.DRAIN_PREFETCH_ACKS) * 4
        + (rules.DRAIN_BACKUP_ACKS, rules.TERMINATE_PREFETCH) * 2
        + (rules.CHECK_PREFETCH, rules.INJECT_FAULT, rules.RESET_STORAGE_IN_FLIGHT,
           rules.DETACH_STORAGE, rules.ATTACH_STORAGE, rules.CLEAR_STORAGE)
    )
)  # fmt: skip
"""Under schedule points, where a loop body is several steps: more storage steps, and a
backend call's drawn outcome (``schedule_point``; a storage step draws ``ok``)."""
POLICIES = ("best_effort", "wait_complete", "timeout")


def storage_case(seed: int, points: bool = False) -> HarnessConfig:
    """The world of walk ``seed`` (with schedule points: ``points``)."""
    return HarnessConfig(
        storage_points=points,
        host_pages=24,
        storage_ranks=(1, 2, 4)[seed % 3],
        storage_batch_pages=1 + seed % 2,
        storage_faults=True,
        storage_policy=POLICIES[seed % 3],  # type: ignore[arg-type]
        seed=seed,
    )


def walk_step(session: Session, rng: random.Random) -> Step:
    """One storage step, mostly one the rules allow now."""
    step = _draw(session, rng)
    for _ in range(16):
        if RULES_BY_NAME[step.rule].why_not(session, step.args) is None:
            return step
        step = _draw(session, rng)
    return step


def _draw(session: Session, rng: random.Random) -> Step:
    driver = session.storage
    assert driver is not None
    rule = rng.choice(POINT_RULES if driver.points is not None else WALK_RULES)
    args: dict[str, StepArg] = {}
    if rule == rules.WRITE_STORAGE.name:
        args = {"pick": rng.randrange(64), "new": rng.random() < 0.5}
    elif rule == rules.PREFETCH.name:
        args = {"pick": rng.randrange(64)}
    elif rule == rules.STORAGE_STEP.name:
        runnable = driver.runnable() if driver.attached else []
        args = {"kind": rng.choice(runnable).value if runnable else "io"}
    elif rule in (rules.TERMINATE_PREFETCH.name, rules.CHECK_PREFETCH.name):
        ongoing = driver.ongoing()
        args = {"request": rng.choice(ongoing) if ongoing else "q?"}
    elif rule == rules.INJECT_FAULT.name:
        kinds = [k for k in FAULT_KINDS if k != "delay"]
        args = {"fault": rng.choice(kinds), "rank": rng.randrange(4), "pages": 1}
    elif rule == SCHEDULE_POINT.name:
        at_call = [
            kind.value
            for kind in driver.runnable()
            if any(
                getattr(position(t, kind), "kind", "") in BACKEND_POINTS for t in driver.l3.tiers
            )
        ]
        args = {
            "thread": rng.choice(at_call) if at_call else "io",
            "outcome": rng.choice(OUTCOMES),
            "rank": rng.randrange(4),
            "at": rng.randrange(AT_MAX + 1),
        }
    elif rule == rules.CLEAR_STORAGE.name:
        args = {"rank": rng.randrange(4)}
    return Step(rule=rule, args=args)


def run_walk(session: Session, seed: int, steps: int) -> None:
    """``steps`` walk steps on ``session``, then its quiescence checks."""
    rng = random.Random(seed)
    for _ in range(steps):
        session.apply(walk_step(session, rng))
    session.finish()


def walk_session(
    implementation: Implementation, name: str, seed: int, points: bool = False
) -> Session:
    return Session(storage_case(seed, points), implementation, name)
