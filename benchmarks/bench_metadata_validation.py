"""What validating ``CpHiCacheNodeMetadata`` costs on the hot path (one record per CP write).

Times building one record with validation (``CpHiCacheNodeMetadata(...)``: INV-13 length,
shape and value rules plus INV-01 host-page alignment) against ``model_construct`` (no
validation), for page size 64, 1 to 64 pages, CP size 1 and 4 (rank 0, which owns the most
pages), with and without a draft host copy. The two are timed interleaved, one call each per
round, so machine noise hits both alike; each cell is the median of ``--rounds`` rounds.

Run: ``.venv/bin/python benchmarks/bench_metadata_validation.py [--rounds N]``.
Prints a markdown table; ``--append FILE`` also appends it with the command to a results file.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache_ref.invariants.models import CpHiCacheNodeMetadata

PAGE_SIZE = 64
PAGE_COUNTS = (1, 4, 16, 64)
CP_SIZES = (1, 4)


def build_fields(pages: int, cp_size: int, with_draft: bool) -> dict[str, Any]:
    """The metadata ``reserve_write_cp`` would record on rank 0 of a round-robin CP layout."""
    owners = torch.arange(pages) % cp_size
    owned_pages = (owners == 0).nonzero().flatten()
    owned_positions = (owned_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()
    host_indices = torch.arange(
        1024 * PAGE_SIZE, 1024 * PAGE_SIZE + owned_positions.numel(), dtype=torch.int64
    )
    return {
        "logical_len": pages * PAGE_SIZE - 5,
        "padded_len": pages * PAGE_SIZE,
        "page_size": PAGE_SIZE,
        "owned_positions": owned_positions,
        "host_indices": host_indices,
        "page_owners": owners.to(torch.int8),
        "draft_host_indices": host_indices + 4096 * PAGE_SIZE if with_draft else None,
    }


def time_pair(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[float, float]:
    """Median nanoseconds of ``first`` and ``second``, called alternately ``rounds`` times."""
    for _ in range(rounds // 10):  # warm up caches and the allocator
        first()
        second()
    first_ns, second_ns = [], []
    gc.disable()
    try:
        for _ in range(rounds):
            start = time.perf_counter_ns()
            first()
            middle = time.perf_counter_ns()
            second()
            end = time.perf_counter_ns()
            first_ns.append(middle - start)
            second_ns.append(end - middle)
    finally:
        gc.enable()
    return statistics.median(first_ns), statistics.median(second_ns)


def run(rounds: int) -> str:
    """The results as a markdown table."""
    lines = [
        "| pages | cp_size | draft | owned tokens | validated (µs) | model_construct (µs) | "
        "overhead (µs) | ratio |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|",
    ]
    for cp_size in CP_SIZES:
        for pages in PAGE_COUNTS:
            for with_draft in (False, True):
                fields = build_fields(pages, cp_size, with_draft)
                CpHiCacheNodeMetadata(**fields)  # valid, or raise now
                validated, constructed = time_pair(
                    lambda: CpHiCacheNodeMetadata(**fields),  # noqa: B023 (timed at once)
                    lambda: CpHiCacheNodeMetadata.model_construct(**fields),  # noqa: B023
                    rounds,
                )
                owned = fields["owned_positions"].numel()
                lines.append(
                    f"| {pages} | {cp_size} | {'yes' if with_draft else 'no'} | {owned} | "
                    f"{validated / 1000:.1f} | {constructed / 1000:.1f} | "
                    f"{(validated - constructed) / 1000:.1f} | {validated / constructed:.1f}x |"
                )
    return "\n".join(lines)


def describe_machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000, help="timed calls per cell")
    parser.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    table = run(args.rounds)
    command = "PYTHONPATH=. .venv/bin/python " + " ".join(
        ["benchmarks/bench_metadata_validation.py", *sys.argv[1:]]
    )
    report = (
        "## CpHiCacheNodeMetadata validation cost (bench_metadata_validation.py)\n\n"
        f"Command: `{command}`  \nMachine: {describe_machine()}  \n"
        f"Median of {args.rounds} interleaved calls per cell; page_size={PAGE_SIZE}, rank 0 of a "
        "round-robin CP layout.\n\n"
        f"{table}\n"
    )
    print(report)
    if args.append is not None:
        with args.append.open("a") as results:
            results.write("\n" + report)


if __name__ == "__main__":
    main()
