"""Which shipped vector catches each seeded mutant first, and what the suite costs to replay.

    .venv/bin/python benchmarks/vector_mutants.py [--suite FILE] [--append benchmarks/RESULTS.md]

For each mutant of ``fuzz/mutants`` the suite is replayed in file order until the first vector
fails (stories come first, so the first failure usually names the scene); the baseline, in the
same run, is the reference replaying the whole suite (every vector must pass). The table says
the first failing vector, the invariant it names, how many vectors ran (and how many were
skipped: a mutant that narrows its configurations, or lacks a capability, skips vectors), and
the seconds to the first failure.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hicache_ref.harness.adapters.registry import get_implementation, list_mutants  # noqa: E402
from hicache_ref.vectors.replay import replay_vector, replay_vectors  # noqa: E402
from hicache_ref.vectors.suite import read_suite, shipped_suite_path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default=None, help="default: the shipped suite")
    parser.add_argument("--append", metavar="FILE", help="append the table to this file")
    args = parser.parse_args()
    path = Path(args.suite) if args.suite else shipped_suite_path()
    header, vectors = read_suite(path)
    start = time.perf_counter()
    baseline = replay_vectors(vectors, get_implementation("reference"), "reference")
    baseline_s = time.perf_counter() - start
    rows = []
    for name in list_mutants():
        implementation = get_implementation(f"mutant:{name}")
        ran = skipped = 0
        first = None
        start = time.perf_counter()
        for vector in vectors:
            result = replay_vector(vector, implementation, f"mutant:{name}")
            skipped += result.status == "skip"
            ran += result.status != "skip"
            if result.status == "fail":
                first = result
                break
        rows.append((name, first, ran, skipped, time.perf_counter() - start))
    caught = sum(first is not None for _, first, *_ in rows)
    lines = [
        f"## Mutants against the conformance vectors (benchmarks/vector_mutants.py), {date.today()}",
        "",
        "Command: `.venv/bin/python benchmarks/vector_mutants.py --append benchmarks/RESULTS.md`  ",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; suite {header.suite} "
        f"(seed {header.seed}, {len(vectors)} vectors, digest {header.digest[:16]}...)  ",
        f"Baseline (same run): the reference replays all {len(vectors)} vectors in "
        f"{baseline_s:.1f}s: {baseline.closing_line()}.",
        "",
        "| mutant | first failing vector | invariant | at | vectors run (skipped) | s |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, first, ran, skipped, seconds in rows:
        if first is None:
            lines.append(f"| {name} | MISSED | - | - | {ran} ({skipped}) | {seconds:.2f} |")
            continue
        where = "quiescence" if first.step is None else f"step {first.step} `{first.op}`"
        lines.append(
            f"| {name} | `{first.vector}` | {first.invariant} | {where} | {ran} ({skipped}) "
            f"| {seconds:.2f} |"
        )
    lines += ["", f"{caught}/{len(rows)} mutants fail at least one vector.", ""]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as out:
            out.write("\n" + text)
    return 0 if caught == len(rows) and baseline.count("fail") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
