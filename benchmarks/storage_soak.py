"""Soak the storage tier on real threads: 4 ranks, faults on, resets under load, a detach.

Prints leaked pages, double frees, threads alive after detach, pages read back (and how many
differed from what was written) and operations per second with faults on, against the same
run's first phase with faults off. Exit status 1 when anything was lost or differed.

    python benchmarks/storage_soak.py --seconds 150
    python benchmarks/storage_soak.py --seconds 150 --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path

import torch

from hicache_ref.harness.campaigns.storage_soak import (
    SOAK_BACKENDS,
    SoakConfig,
    SoakReport,
    run_soak,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="wall time of the soak")
    parser.add_argument("--ranks", type=int, default=4, choices=range(1, 5), metavar="1..4")
    parser.add_argument("--backend", choices=SOAK_BACKENDS, default="memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-faults", action="store_true", help="soak without injected faults")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--append", type=Path, help="append a results section to this file")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    return args


def render(report: SoakReport, command: str) -> str:
    rows = [
        ("leaked host pages", report.leaked_pages),
        ("double frees", report.double_frees),
        ("threads alive after detach", report.threads_alive_after_detach),
        ("pages read back", report.pages_read_back),
        ("pages read back not byte-equal", report.pages_mismatched),
        (
            "collective violations / thread errors",
            len(report.violations) + len(report.thread_errors),
        ),
        ("backups / prefetches started", f"{report.backups} / {report.prefetches}"),
        ("resets with work in flight", report.resets),
        ("faults injected", report.faults_injected),
        ("ops/s, faults off (first 20%, baseline)", f"{report.ops_per_s_baseline:.0f}"),
        ("ops/s, faults on and resets", f"{report.ops_per_s_faults:.0f}"),
    ]
    lines = [
        "## Storage tier soak on real threads (storage_soak.py)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}; {report.ranks} ranks, backend {report.backend}, "
        f"{report.seconds:g} s, thread executor",
        "",
        "| figure | value |",
        "|---|---:|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # injected faults are logged by the tier as they happen; the report counts them instead
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    config = SoakConfig(
        seconds=args.seconds,
        ranks=args.ranks,
        backend=args.backend,
        seed=args.seed,
        faults=not args.no_faults,
    )
    report = run_soak(config)
    command = "python benchmarks/storage_soak.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = render(report, command.strip())
    print(text)
    for problem in (report.violations + report.thread_errors)[:5]:
        print(f"problem: {problem}")
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2))
    if args.append:
        with args.append.open("a") as out:
            out.write("\n" + text)
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
