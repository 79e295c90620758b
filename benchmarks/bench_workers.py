"""Steps/s of a fleet on one runner: ``--workers 1`` against N workers, in the same run.

    python benchmarks/bench_workers.py                          # 1 vs 2 workers, 60 s each, 3 rounds
    python benchmarks/bench_workers.py --workers 1,2,4,8,14,16  # a 16-core runner
    python benchmarks/bench_workers.py --device cuda --workers 1,14   # workers sharing one GPU
    python benchmarks/bench_workers.py --append benchmarks/RESULTS.md # record the table

Each measurement is one ``run_fleet`` (``hicache_ref/fleet/workers.py``) over the reference
implementation: one worker runs in this process, more are spawned. Steps/s is the fleet's
protocol steps over the campaign time of its longest worker (the time its rounds ran: a
worker's interpreter start-up is not fuzzing and is left out; it is reported beside). The
configurations take turns, round after round, so a change of load hits each alike; the table
gives the median steps/s of each and its speedup over the median of one worker. Goals (issue
20): >= 1.6x with 2 workers on a 2-core machine, >= 10x with 14 on a 16-core GPU runner.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hicache_ref.fleet.merge import get_leaves
from hicache_ref.fleet.shards import Shard
from hicache_ref.fleet.workers import plan_workers, run_fleet
from hicache_ref.harness.campaigns.profiles import PROFILES


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of worker counts: 1,2,4"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive worker counts such as 1,2")
    return sorted(set(counts) | {1})  # one worker is the baseline, always measured


def measure(
    workers: int, args: argparse.Namespace, seed: int
) -> tuple[float, float, int, list[float]]:
    """(steps/s over the campaign time, wall seconds of the whole run, steps, each worker's
    campaign seconds) of one fleet: the fleet's campaign time is its longest worker's, so a
    worker that runs on past the others (a round finishing after the budget) costs every
    other core its time."""
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as out:
        tasks = plan_workers(
            "reference", seed=seed, shard=Shard(), workers=workers, seconds=args.budget,
            profile=args.profile, out_dir=out, stop_on_failure=False, device=args.device,
        )  # fmt: skip
        start = time.monotonic()
        report = run_fleet(tasks)
        wall = time.monotonic() - start
    assert not report.failures, f"the reference failed: {report.failures[0]['error']}"
    seconds = [part.seconds for part in get_leaves(report)]
    return report.steps / max(report.seconds, 1e-9), wall, report.steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=parse_counts, default=[1, 2], help="e.g. 1,2,4,14")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per worker count")
    parser.add_argument("--profile", default="campaign", choices=sorted(PROFILES))
    parser.add_argument("--device", default="sim", choices=("sim", "cuda"))
    parser.add_argument("--append", type=Path, help="append the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each spawned worker does: the baseline gets no extra threads
    rates: dict[int, list[float]] = {n: [] for n in args.workers}
    walls: dict[int, list[float]] = {n: [] for n in args.workers}
    spans: dict[int, list[list[float]]] = {n: [] for n in args.workers}
    for round_index in range(args.rounds):
        for workers in args.workers:
            rate, wall, steps, seconds = measure(workers, args, seed=1000 * round_index)
            rates[workers].append(rate)
            walls[workers].append(wall)
            spans[workers].append(seconds)
            print(f"round {round_index}: {workers} worker(s): {steps} steps, {rate:,.0f} steps/s, "
                  f"{wall:.1f} s wall, worker campaign s {min(seconds):.1f}-{max(seconds):.1f}",
                  flush=True)  # fmt: skip
    base = statistics.median(rates[1])
    command = " ".join(["python", "benchmarks/bench_workers.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, device {args.device}, "
        f"profile {args.profile}, {args.budget:g} s per measurement, {args.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "",
        "| workers | steps/s (median) | per round | speedup over 1 worker | wall s (median) "
        "| worker campaign s, shortest-longest (per round) |",
        "|---:|---:|---|---:|---:|---|",
    ]
    for workers in args.workers:
        median = statistics.median(rates[workers])
        rounds = ", ".join(f"{rate:,.0f}" for rate in rates[workers])
        lines.append(
            f"| {workers} | {median:,.0f} | {rounds} | {median / base:.2f}x | "
            f"{statistics.median(walls[workers]):.1f} | "
            + ", ".join(f"{min(s):.1f}-{max(s):.1f}" for s in spans[workers])
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    if args.append is not None:
        with args.append.open("a") as results:
            results.write(
                f"\n## Workers: steps/s against one worker (bench_workers.py)\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
