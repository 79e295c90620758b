"""Where a paged transfer's time goes: a CUPTI trace of the copy engine, or kernels for ncu.

``benchmarks/transfer.py`` says how fast each path is; this says why. Two modes, same pools as
``transfer.py`` (random pages, bf16, CPU index tensors, bytes verified first):

- ``--mode trace``: ``torch.profiler`` (CUPTI) around ``--layers`` per-layer H2D loads (or one
  all-layer D2H backup); the trace's runtime calls and memcpy activities give, per case: copies,
  CPU us per copy inside ``cudaMemcpyBatchAsync``, the copy engine's us per copy and the rate it
  moves one copy at, and how busy the engine was between the first copy's start and the last
  one's end. An engine busy ~100% at a low rate is bound by the engine on that copy size; an
  engine idle between copies is bound by the issue.
- ``--mode kernel``: just the launches (warm-up first), for ``ncu --clock-control none -k
  regex:paged_row_copy`` to profile the Triton kernel's memory throughput and stalls.
- ``--mode pinned``: one pinned ``--pinned-mib`` copy H2D, then one D2H, each inside its own
  ``cudaProfilerStart``/``Stop`` range, for ``ncu --replay-mode app-range`` to read the copy
  engine's PCIe counters (``pcie__read_bytes``, ``pcie__write_bytes``) beside the kernel's.

    python benchmarks/transfer_profile.py --mode trace --cases batch:mla:16:layer_first:h2d
    ncu --clock-control none -k regex:paged_row_copy -c 2 --section SpeedOfLight \\
        python benchmarks/transfer_profile.py --mode kernel --cases triton:mla:16:page_first:h2d
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transfer as bench

from hicache_ref.device.cuda import CudaDevice


@dataclass(frozen=True)
class ProfileCase:
    path: str
    rows: str
    page_size: int
    layout: str
    direction: str

    @property
    def label(self) -> str:
        return f"{self.path} {self.rows} page {self.page_size} {self.layout} {self.direction}"


def parse_case(text: str) -> ProfileCase:
    try:
        path, rows, page, layout, direction = text.split(":")
        case = ProfileCase(path, rows, int(page), layout, direction)
    except ValueError:
        raise SystemExit(
            f"transfer_profile: case {text!r} is not PATH:ROWS:PAGE:LAYOUT:DIRECTION "
            "(e.g. batch:mla:16:layer_first:h2d)"
        ) from None
    if path not in ("batch", "triton", "runs") or direction not in ("h2d", "d2h"):
        raise SystemExit(f"transfer_profile: case {text!r}: path batch|triton|runs, h2d|d2h")
    return case


def issue(world: bench.World, case: ProfileCase, path: bench.Path_) -> float:
    """Issue the case's transfer; the host's microseconds per layer to issue it."""
    if case.direction == "h2d":
        issue_us: list[float] = []
        bench.issue_loads(world, path, issue_us)
        return statistics.median(issue_us)
    start = time.perf_counter()
    bench.issue_backup(world, path)
    return (time.perf_counter() - start) * 1e6 / world.device_pool.layer_num


def summarise(trace_file: str, case: ProfileCase, row_bytes: int, issue_us: float) -> str:
    with open(trace_file, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    copies = [e for e in spans if e.get("cat") == "gpu_memcpy"]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    work = copies or kernels
    if not work:
        return f"| {case.label} | no GPU activity in the trace | | | | | |"
    start = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    busy = sum(e["dur"] for e in work)
    moved = row_bytes
    per_copy_us = statistics.median(e["dur"] for e in work)
    copy_bytes = moved / len(work)
    return (
        f"| {case.label} | {len(work)} {'copies' if copies else 'kernels'} | "
        f"{copy_bytes / 1024:.1f} | {issue_us:.0f} | {per_copy_us:.0f} | "
        f"{copy_bytes / per_copy_us / 1e3:.1f} | {100 * busy / (end - start):.0f}% | "
        f"{moved / (end - start) / 1e3:.1f} |"
    )


def pinned_ranges(mib: int) -> int:
    """One pinned copy each way, each in its own profiler range (bytes checked after)."""
    nbytes = mib << 20
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    back = torch.empty_like(host).pin_memory()
    device.copy_(host)  # warm-up
    torch.cuda.synchronize()
    copies: list[tuple[str, Callable[[], object]]] = [
        ("h2d", lambda: device.copy_(host, non_blocking=True)),
        ("d2h", lambda: back.copy_(device, non_blocking=True)),
    ]
    for name, copy in copies:
        torch.cuda.profiler.start()  # type: ignore[no-untyped-call]
        copy()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]
        print(f"| pinned {mib} MiB {name} | profiled in its own range |")
    # Verify the bytes went both ways
    if not torch.equal(host, back):
        print("pinned copy: bytes differ after the round trip")
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("trace", "kernel", "pinned"), default="trace")
    parser.add_argument("--cases", nargs="+", default=[], type=parse_case)
    parser.add_argument("--pinned-mib", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--grid", type=int, default=8, help="triton programs")
    parser.add_argument("--tile", default="16x8", help="triton ROWSxWARPS")
    args = parser.parse_args(argv)
    # Verify something to profile
    if args.mode != "pinned" and not args.cases:
        parser.error(f"--mode {args.mode} needs --cases PATH:ROWS:PAGE:LAYOUT:DIRECTION ...")
    rows_w = bench.parse_tiles(args.tile, parser)[0]
    if not torch.cuda.is_available():
        print("transfer_profile.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    if args.mode == "pinned":
        return pinned_ranges(args.pinned_mib)
    setup = bench.parse(["--tokens", str(args.tokens), "--layers", str(args.layers), "--reps", "5"])
    cuda = CudaDevice()
    stream = bench.new_stream()
    print("| case | GPU work items (one per layer) | KiB each | host us to issue a layer "
          "(median) | GPU us per item (median) | GB/s within an item | GPU busy over the span "
          "| GB/s over the span |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in args.cases:
        world = bench.build_world(setup, bench.Case(case.rows, case.page_size, case.layout), cuda)
        grid = args.grid if case.path == "triton" else None
        path = bench.Path_(case.path, case.path, grid, rows_w if grid else None)
        # Verify the bytes before profiling (a fast wrong path profiles nothing useful)
        if not bench.verify(world, path, stream):
            print(f"| {case.label} | bytes differ from the gather path: not profiled |")
            continue
        with torch.cuda.stream(stream):
            issue(world, case, path)  # warm-up: plans cached, kernels compiled
        torch.cuda.synchronize()
        if args.mode == "kernel":
            with torch.cuda.stream(stream):
                issue(world, case, path)
            torch.cuda.synchronize()
            print(f"| {case.label} | launched for ncu | | | | | | |")
            continue
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof, torch.cuda.stream(stream):
            issue_us = issue(world, case, path)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            trace_file = handle.name
        prof.export_chrome_trace(trace_file)
        print(summarise(trace_file, case, world.bytes_per_direction, issue_us), flush=True)
        os.unlink(trace_file)
        del world
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
