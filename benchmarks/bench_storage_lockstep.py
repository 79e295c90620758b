"""What the storage oracle in lockstep costs: storage steps per CPU second with and without it.

A fixed set of storage cases (seeded random walks over the storage rules: writes, prefetches,
every runnable thread's steps, drains, terminations, faults, resets, detach/attach, clears, on
1, 2 and 4 ranks with batches of 1 and 2 pages) runs twice per round in one process, once with
``harness/lockstep/storage.py`` following it and once without, interleaved; the script reports
the median over rounds of applied steps per CPU second (``time.process_time``, so other load on
a shared machine does not count) and how many storage steps the oracle compared.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_storage_lockstep.py --rounds 5 --cases 40
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.lockstep.storage import attach_storage_lockstep
from hicache_ref.harness.steps.rules import RULES as RULES_BY_NAME
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.storage.fault_injection import FAULT_KINDS

STEPS_PER_CASE = 80
RULES = (
    ("storage_step",) * 10 + ("write_storage", "prefetch") * 3
    + ("drain_prefetch_acks", "drain_backup_acks") * 2
    + ("terminate_prefetch", "check_prefetch", "inject_fault", "reset_storage_in_flight",
       "detach_storage", "attach_storage", "clear_storage")
)  # fmt: skip
"""The rules a case draws from, weighted (storage steps first)."""


def _step(session: Session, rng: random.Random) -> Step:
    for _ in range(16):  # a rule its discipline allows now, mostly
        step = _draw(session, rng)
        if RULES_BY_NAME[step.rule].why_not(session, step.args) is None:
            return step
    return step


def _draw(session: Session, rng: random.Random) -> Step:
    rule = rng.choice(RULES)
    driver = session.tree.storage
    assert driver is not None
    args: dict[str, object] = {}
    if rule in ("write_storage", "prefetch"):
        args = {"pick": rng.randrange(64)} | ({"new": rng.random() < 0.5} if rule[0] == "w" else {})
    elif rule == "storage_step":
        runnable = driver.runnable() if driver.attached else []
        args = {"kind": rng.choice(runnable).value if runnable else "io"}
    elif rule in ("terminate_prefetch", "check_prefetch"):
        ongoing = driver.ongoing()
        args = {"request": rng.choice(ongoing) if ongoing else "q?"}
    elif rule == "inject_fault":
        kinds = [k for k in FAULT_KINDS if k != "delay"]
        args = {"fault": rng.choice(kinds), "rank": rng.randrange(4), "pages": 1}
    elif rule == "clear_storage":
        args = {"rank": rng.randrange(4)}
    return Step(rule=rule, args=args)  # type: ignore[arg-type]


def run_cases(cases: int, follow: bool) -> tuple[int, int, float]:
    """Applied steps, storage steps compared, CPU seconds."""
    steps = compared = 0
    began = time.process_time()
    for seed in range(cases):
        rng = random.Random(seed)
        config = HarnessConfig(
            host_pages=24,
            storage_ranks=(1, 2, 4)[seed % 3],
            storage_batch_pages=1 + seed % 2,
            storage_faults=True,
            seed=seed,
        )
        session = Session(config, ReferenceImplementation(), "reference")
        follower = attach_storage_lockstep(session) if follow else None
        for _ in range(STEPS_PER_CASE):
            session.apply(_step(session, rng))
            steps += 1
        session.finish()
        compared += follower.steps if follower is not None else 0
    return steps, compared, time.process_time() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=int, default=30)
    args = parser.parse_args()
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    rates: dict[bool, list[float]] = {True: [], False: []}
    compared = 0
    for _ in range(args.rounds):
        for follow in (False, True):
            steps, seen, cpu = run_cases(args.cases, follow)
            rates[follow].append(steps / cpu)
            compared = max(compared, seen)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"storage cases: {args.cases} x {STEPS_PER_CASE} steps, {args.rounds} rounds")
    print(f"without the storage oracle: {off:.0f} steps per CPU second")
    print(f"with the storage oracle:    {on:.0f} steps per CPU second ({on / off - 1:+.1%})")
    print(f"storage steps compared per round: {compared}")


if __name__ == "__main__":
    main()
