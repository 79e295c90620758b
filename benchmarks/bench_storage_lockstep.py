"""What the storage oracle in lockstep costs: storage steps per CPU second with and without it.

A fixed set of storage cases (seeded random walks over the storage rules: writes, prefetches,
every runnable thread's steps, drains, terminations, faults, resets, detach/attach, clears, on
1, 2 and 4 ranks with batches of 1 and 2 pages) runs twice per round in one process, once with
``harness/lockstep/storage.py`` following it and once without, interleaved; the script reports
the median over rounds of applied steps per CPU second (``time.process_time``, so other load on
a shared machine does not count) and how many storage steps the oracle compared.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_storage_lockstep.py --rounds 5 --cases 40

``--points``: the same walks in worlds with schedule points (a storage step is one grant of a
thread kind to its next point; the oracle follows each).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.lockstep.storage import attach_storage_lockstep
from hicache_ref.harness.lockstep.storage_walk import run_walk, walk_session

STEPS_PER_CASE = 80


def run_cases(cases: int, follow: bool, points: bool = False) -> tuple[int, int, float]:
    """Applied steps, storage steps compared, CPU seconds."""
    steps = compared = 0
    began = time.process_time()
    for seed in range(cases):
        session = walk_session(ReferenceImplementation(), "reference", seed, points)
        follower = attach_storage_lockstep(session) if follow else None
        run_walk(session, seed, STEPS_PER_CASE)
        steps += STEPS_PER_CASE
        compared += follower.steps if follower is not None else 0
    return steps, compared, time.process_time() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=int, default=30)
    parser.add_argument("--points", action="store_true", help="worlds with schedule points")
    args = parser.parse_args()
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    rates: dict[bool, list[float]] = {True: [], False: []}
    compared = 0
    for _ in range(args.rounds):
        for follow in (False, True):
            steps, seen, cpu = run_cases(args.cases, follow, args.points)
            rates[follow].append(steps / cpu)
            compared = max(compared, seen)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    where = "with schedule points" if args.points else "whole loop bodies"
    print(f"storage cases ({where}): {args.cases} x {STEPS_PER_CASE} steps, {args.rounds} rounds")
    print(f"without the storage oracle: {off:.0f} steps per CPU second")
    print(f"with the storage oracle:    {on:.0f} steps per CPU second ({on / off - 1:+.1%})")
    print(f"storage steps compared per round: {compared}")


if __name__ == "__main__":
    main()
