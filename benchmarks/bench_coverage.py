"""What ``run --coverage`` costs: steps/s of a campaign with coverage against one without it.

    python benchmarks/bench_coverage.py                              # 30 s each, 2 rounds, ci
    python benchmarks/bench_coverage.py --profiles ci,campaign --append benchmarks/RESULTS.md

Each measurement is one worker's campaign in this process (``fleet/workers.run_fleet``) over
the reference, with or without coverage.py's tracer over its controller and pools
(``campaign/coverage.py``); the two take turns, round after round, on the same seeds, so a
change of load hits each alike. The table gives each one's median steps/s, the cost (the share
of steps/s lost with coverage) and the line and branch coverage reached.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import coverage
import torch

from hicache_ref.fleet.plots import get_coverage_percent
from hicache_ref.fleet.shards import Shard
from hicache_ref.fleet.workers import plan_workers, run_fleet
from hicache_ref.harness.campaigns.profiles import PROFILES


def measure(measured: bool, profile: str, budget: float, seed: int) -> tuple[float, str]:
    """(steps/s, the coverage reached) of one campaign."""
    with tempfile.TemporaryDirectory(prefix="bench-coverage-") as out:
        tasks = plan_workers(
            "reference", seed=seed, shard=Shard(), workers=1, seconds=budget, profile=profile,
            out_dir=out, stop_on_failure=False, coverage=measured,
        )  # fmt: skip
        report = run_fleet(tasks)
    assert not report.failures, f"the reference failed: {report.failures[0]['error']}"
    lines = get_coverage_percent(report.coverage, "lines")
    branches = get_coverage_percent(report.coverage, "arcs")
    reached = "-" if lines is None else f"{lines:.1f}% / {branches or 0:.1f}%"
    return report.steps / max(report.seconds, 1e-9), reached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each")
    parser.add_argument("--profiles", default="ci", help="comma-separated, e.g. ci,campaign")
    parser.add_argument("--append", type=Path, help="append the table to this file")
    args = parser.parse_args()
    profiles = [p for p in args.profiles.split(",") if p]
    assert all(p in PROFILES for p in profiles), f"profiles are {sorted(PROFILES)}"
    torch.set_num_threads(1)
    rows = []
    for profile in profiles:
        rates: dict[bool, list[float]] = {False: [], True: []}
        reached = ""
        for round_index in range(args.rounds):
            for measured in (False, True):
                rate, seen = measure(measured, profile, args.budget, seed=1000 * round_index)
                rates[measured].append(rate)
                reached = seen if measured else reached
                print(f"{profile} round {round_index}: coverage {'on' if measured else 'off'}: "
                      f"{rate:,.0f} steps/s {seen}", flush=True)  # fmt: skip
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append(
            f"| {profile} | {off:,.0f} ({', '.join(f'{r:,.0f}' for r in rates[False])}) | "
            f"{on:,.0f} ({', '.join(f'{r:,.0f}' for r in rates[True])}) | "
            f"{1 - on / off:.0%} | {reached} |"
        )
    command = " ".join(["python", "benchmarks/bench_coverage.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, coverage {coverage.__version__}, torch {torch.__version__}, "
        f"{args.budget:g} s per measurement, {args.rounds} rounds, one worker, load average "
        f"{os.getloadavg()[0]:.1f} at the end",
        "",
        "| profile | steps/s without (median; rounds) | steps/s with --coverage | cost | "
        "lines / branches covered |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    table = "\n".join(lines)
    print(table)
    if args.append is not None:
        with args.append.open("a") as results:
            results.write(
                "\n## Coverage of the implementation under test: what --coverage costs "
                f"(bench_coverage.py)\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
