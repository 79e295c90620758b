"""What bounds the Triton copy kernel where it misses the targets: one factor varied at a time.

``benchmarks/transfer.py`` says how fast each path is against the pinned copy; this isolates
why the kernel stops where it does. Same pools and random pages as ``transfer.py``, bytes
verified against the gather reference before anything is timed, CUDA events, one warm-up,
medians of ``--reps``. Experiments (``--experiments``, comma separated):

- ``ceiling``: the kernel over contiguous pairs (host slot ``i`` to device row ``i``: a plain
  streaming copy through zero-copy loads and stores) against random pages, over grids and
  tiles, with ``batch`` on the same contiguous pairs as the copy engine's control. If
  contiguous rows stop where random pages do, the bound is the SMs' zero-copy path itself, not
  the kernel's gather.
- ``span``: MHA ``page_first`` H2D over worlds of more layers (a layer's rows spread over a
  wider host span: every host page holds all layers of its tokens), with the pairs in random
  order and sorted by host slot. A rate that falls with the span and comes back when sorted
  points at address translation (TLB reach), not at the link.
- ``priority``: the kernel beside a compute-bound matmul on another stream, its load stream at
  the default and at the highest stream priority (blocks of a higher-priority stream are
  scheduled first when an SM frees up); GB/s and the matmul's slowdown.
- ``wait``: the same beside the matmul under CUPTI: how long each per-layer copy kernel runs and
  waits, and whether it starts when a matmul kernel ends (its blocks find no SM before that).
- ``bidir``: per-layer loads and backups on two streams at once, per grid and through ``batch``,
  issued by one host thread (interleaved) and by two (one per stream, as an engine's load and
  write threads), against the same run's one-way figures and the bidirectional pinned copy.
- ``issue``: ``cProfile`` over per-layer loads after a warm-up: where the CPU microseconds of
  one layer's issue go (per call, by function).

    python benchmarks/transfer_bounds.py --experiments ceiling,priority
    python benchmarks/transfer_bounds.py --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import faulthandler
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transfer as bench

from hicache_ref.device import CudaDevice
from hicache_ref.pools.transfer import PLAN_CACHE

EXPERIMENTS = ("ceiling", "span", "priority", "wait", "bidir", "issue")
OUT: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)


def table(title: str, head: str, rows: list[str]) -> None:
    columns = head.count("|") - 1
    OUT.extend(["", title, "", head, "|" + "---|" * columns, *rows])
    say(f"\n{title}\n{head}")


def row(line: str) -> str:
    say(line)
    return line


# ------------------------------------------------------------------ worlds
def world_args(args: argparse.Namespace, layers: int) -> argparse.Namespace:
    return bench.parse(["--tokens", str(args.tokens), "--layers", str(layers), "--reps",
                        str(args.reps), "--mha-heads", str(args.mha_heads)])  # fmt: skip


def with_pairs(world: bench.World, order: str) -> bench.World:
    """``world`` with its pairs ``random`` (as built), ``sorted`` by host slot, or
    ``contiguous`` (host slot i to device row i, loads in the first half, backups in the
    second)."""
    if order == "random":
        return world
    if order == "sorted":
        load = torch.argsort(world.load_host)
        backup = torch.argsort(world.backup_host)
        changed = dataclasses.replace(
            world,
            load_host=world.load_host[load],
            load_device=world.load_device[load],
            backup_host=world.backup_host[backup],
            backup_device=world.backup_device[backup],
        )
    elif order == "contiguous":
        tokens = world.load_host.numel()
        first, second = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
        changed = dataclasses.replace(
            world, load_host=first, load_device=first.clone(), backup_host=second,
            backup_device=second.clone(),
        )  # fmt: skip
    else:
        raise ValueError(order)
    changed.expected_load = bench.expected_rows(changed, changed.load_host)
    return changed


def checked(world: bench.World, path: bench.Path_, stream: torch.cuda.Stream) -> bool:
    PLAN_CACHE.clear()
    return bench.verify(world, path, stream)


def h2d_ms(world: bench.World, path: bench.Path_, stream: torch.cuda.Stream, reps: int) -> float:
    """Median milliseconds of one per-layer load of every layer (bytes already verified)."""
    return bench.median_ms(
        reps, lambda: bench.time_on_stream(stream, lambda: bench.issue_loads(world, path))
    )


def one_way(
    world: bench.World, path: bench.Path_, stream: torch.cuda.Stream, reps: int
) -> tuple[float, float]:
    """Per-layer H2D and all-layer D2H GB/s of ``path`` (bytes already verified)."""
    d2h_ms = bench.median_ms(
        reps, lambda: bench.time_on_stream(stream, lambda: bench.issue_backup(world, path))
    )
    nbytes = world.bytes_per_direction
    return bench.gbps(nbytes, h2d_ms(world, path, stream, reps)), bench.gbps(nbytes, d2h_ms)


def both_ways_gbps(
    world: bench.World,
    path: bench.Path_,
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    reps: int,
) -> float:
    """Loads and backups of every layer on two streams at once, total GB/s."""
    load, write = streams

    def both_ways() -> float:
        return bench.time_pair(
            streams, interleave=lambda: bench.interleaved(world, path, load, write)
        )

    return bench.gbps(2 * world.bytes_per_direction, bench.median_ms(reps, both_ways))


def threaded_gbps(
    world: bench.World,
    path: bench.Path_,
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    reps: int,
) -> float:
    """As ``both_ways_gbps``, each stream issued by its own host thread (as an engine's load
    and write threads do), so one direction's issue cost does not hold the other's."""
    load, write = streams

    def both_ways() -> float:
        start, end = bench.new_event(), bench.new_event()
        write_done = bench.new_event(timing=False)
        torch.cuda.synchronize()
        start.record(load)
        write.wait_event(start)
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def backups() -> None:
            try:
                barrier.wait()
                with torch.cuda.stream(write):
                    bench.issue_backup(world, path, per_layer=True)
                write_done.record(write)
            except BaseException as error:  # re-raised by the issuing thread
                errors.append(error)
                barrier.abort()

        thread = threading.Thread(target=backups)
        thread.start()
        barrier.wait()
        with torch.cuda.stream(load):
            bench.issue_loads(world, path)
        thread.join()
        if errors:
            raise errors[0]
        load.wait_event(write_done)
        end.record(load)
        end.synchronize()
        return float(start.elapsed_time(end))

    return bench.gbps(2 * world.bytes_per_direction, bench.median_ms(reps, both_ways))


def release() -> None:
    PLAN_CACHE.clear()
    torch.cuda.empty_cache()


def triton(grid: int, tile: tuple[int, int]) -> bench.Path_:
    return bench.Path_("triton", "triton", grid, tile)


# ------------------------------------------------------------------ experiments
def ceiling(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    rows: list[str] = []
    stream = bench.new_stream()
    base = bench.build_world(
        world_args(args, args.layers), bench.Case("mla", 64, "layer_first"), cuda
    )
    for order in ("random", "contiguous"):
        world = with_pairs(base, order)
        paths = [triton(grid, tile) for tile in args.tiles for grid in args.grids]
        paths += [bench.Path_("batch", "batch")]
        for path in paths:
            if not checked(world, path, stream):
                rows.append(row(f"| {order} | {path.label} | BYTE MISMATCH | | | |"))
                continue
            h2d, d2h = one_way(world, path, stream, args.reps)
            rows.append(row(f"| {order} | {path.label} | {h2d:.1f} | {bench.pct(h2d, pinned.h2d)} "
                            f"| {d2h:.1f} | {bench.pct(d2h, pinned.d2h)} |"))  # fmt: skip
    table(
        f"Ceiling: MLA rows, page 64, `layer_first`, {args.layers} layers, random pages against "
        "contiguous pairs",
        "| pairs | path | H2D per layer GB/s | of pinned | D2H all layers GB/s | of pinned |",
        rows,
    )


def span(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    rows: list[str] = []
    stream = bench.new_stream()
    path = triton(args.grids[0], args.tiles[0])
    for rows_kind in args.span_rows:
        for layers in args.span_layers:
            base = bench.build_world(
                world_args(args, layers), bench.Case(rows_kind, 16, "page_first"), cuda
            )
            host_gb = (
                sum(b.numel() * b.element_size() for b in base.host_pool.buffers.values()) / 1e9
            )
            for order in ("random", "sorted"):
                world = with_pairs(base, order)
                if not checked(world, path, stream):
                    rows.append(
                        row(
                            f"| {rows_kind} | {layers} | {host_gb:.2f} | {order} | BYTE MISMATCH | |"
                        )
                    )
                    continue
                h2d = bench.gbps(world.bytes_per_direction, h2d_ms(world, path, stream, args.reps))
                rows.append(row(f"| {rows_kind} | {layers} | {host_gb:.2f} | {order} | {h2d:.1f} | "
                                f"{bench.pct(h2d, pinned.h2d)} |"))  # fmt: skip
            del base
            release()
    table(
        f"Span: `page_first` page 16 H2D through {path.label}, worlds of more layers",
        "| rows | layers | host pool GB | pair order | H2D per layer GB/s | of pinned |",
        rows,
    )


def high_priority_stream() -> torch.cuda.Stream:
    """A stream at the device's highest priority (the lowest number the runtime allows)."""
    try:
        _, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    except AttributeError:  # older torch: -1 is the highest it exposes
        greatest = -1
    return torch.cuda.Stream(priority=greatest)  # type: ignore[no-untyped-call]


def priority(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    rows: list[str] = []
    compute = bench.new_stream()
    matmul = bench.make_matmul(args.matmul_size, compute)
    streams = {"default": bench.new_stream(), "highest": high_priority_stream()}
    for rows_kind in ("mla", "mha"):
        world = bench.build_world(
            world_args(args, args.layers), bench.Case(rows_kind, 64, "layer_first"), cuda
        )
        for grid in args.priority_grids:
            path = triton(grid, args.tiles[0])
            if not checked(world, path, streams["default"]):
                rows.append(row(f"| {rows_kind} | {path.label} | | BYTE MISMATCH | | | | |"))
                continue
            alone_ms = h2d_ms(world, path, streams["default"], args.reps)
            for name, stream in streams.items():
                line = bench.overlap(world, path, matmul, stream, compute, alone_ms, pinned, args)
                cells = line.strip("|").split("|")
                rows.append(
                    row(f"| {rows_kind} | {path.label} | {name} |" + "|".join(cells[4:]) + "|")
                )
        release()
    table(
        f"Priority: H2D beside a {args.matmul_size}x{args.matmul_size} bf16 matmul loop, page 64 "
        "`layer_first`, the load stream at the default and the highest priority",
        "| rows | path | load stream priority | H2D beside matmul GB/s | of pinned | matmul ms "
        "alone | beside | slowdown |",
        rows,
    )


@dataclasses.dataclass(frozen=True)
class Span:
    """One kernel CUPTI saw: its name, start and end (us) and launch grid."""

    name: str
    start: float
    end: float
    grid: str

    @property
    def us(self) -> float:
        return self.end - self.start


def trace_kernels(run: Callable[[], None]) -> list[Span]:
    """The kernels CUPTI saw while ``run`` ran, in start order."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        trace_file = handle.name
    prof.export_chrome_trace(trace_file)
    with open(trace_file, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    os.unlink(trace_file)
    spans = [
        Span(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"]),
             str(e.get("args", {}).get("grid")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "kernel"
    ]  # fmt: skip
    return sorted(spans, key=lambda span: span.start)


def matmul_phase(at: float, gemms: list[Span]) -> float:
    """How far the matmul kernel running at ``at`` had got (0..1); 1.0 between kernels."""
    for gemm in gemms:
        if gemm.start <= at < gemm.end:
            return (at - gemm.start) / gemm.us
    return 1.0


def wait(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    """Where a copy kernel beside the matmul starts: CUPTI's kernel spans on both streams."""
    rows: list[str] = []
    compute, load = bench.new_stream(), bench.new_stream()
    matmul = bench.make_matmul(args.matmul_size, compute)
    for rows_kind in ("mla", "mha"):
        world = bench.build_world(
            world_args(args, args.layers), bench.Case(rows_kind, 64, "layer_first"), cuda
        )
        path = triton(args.priority_grids[-1], args.tiles[0])
        if not checked(world, path, load):
            rows.append(row(f"| {rows_kind} | {path.label} | BYTE MISMATCH | | | | | |"))
            continue
        layers = world.device_pool.layer_num
        alone_ms = h2d_ms(world, path, load, args.reps)
        count = max(4, int(1.5 * alone_ms / matmul.one_ms) + 1)

        def beside(
            world: bench.World = world, path: bench.Path_ = path, count: int = count
        ) -> None:
            with torch.cuda.stream(compute):
                matmul.loop(count)
            with torch.cuda.stream(load):
                bench.issue_loads(world, path)

        beside()  # warm-up
        torch.cuda.synchronize()
        kernels = trace_kernels(beside)
        copies = [k for k in kernels if "paged_row_copy" in k.name]
        gemms = [k for k in kernels if "paged_row_copy" not in k.name]
        periods = [after.start - before.start for before, after in itertools.pairwise(copies)]
        phases = [matmul_phase(copy.start, gemms) for copy in copies[1:]]
        tail = sum(phase >= 0.9 for phase in phases)
        rows.append(row(
            f"| {rows_kind} | {path.label} | {len(copies)} | {1e3 * alone_ms / layers:.0f} | "
            f"{statistics.median(k.us for k in copies):.0f} | {statistics.median(periods):.0f} | "
            f"{statistics.median(k.us for k in gemms):.0f} | {gemms[0].grid if gemms else '-'} | "
            f"{statistics.median(phases):.2f} | {100 * tail / max(1, len(phases)):.0f}% |"
        ))  # fmt: skip
        release()
    table(
        f"Wait: per-layer copy kernels beside a {args.matmul_size}x{args.matmul_size} bf16 matmul "
        "loop (CUPTI kernel spans, medians); a copy kernel's phase is how far the matmul kernel "
        "running when it started had got (1.0: it started between two matmul kernels)",
        "| rows | path | copy kernels | us per layer alone | us per copy kernel beside | us from "
        "one copy kernel's start to the next | us per matmul kernel | matmul grid | phase of the "
        "matmul at a copy's start | copies starting in a matmul's last tenth or between two |",
        rows,
    )


def bidir(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    rows: list[str] = []
    load, write = bench.new_stream(), bench.new_stream()
    paths = [triton(grid, args.tiles[0]) for grid in args.bidir_grids] + [
        bench.Path_("batch", "batch")
    ]
    for rows_kind in args.bidir_rows:
        world = bench.build_world(
            world_args(args, args.layers), bench.Case(rows_kind, 64, "layer_first"), cuda
        )
        for path in paths:
            if not checked(world, path, load):
                rows.append(row(f"| {rows_kind} | {path.label} | BYTE MISMATCH | | | | | | |"))
                continue
            h2d, d2h = one_way(world, path, load, args.reps)
            both = both_ways_gbps(world, path, (load, write), args.reps)
            threads = threaded_gbps(world, path, (load, write), args.reps)
            best = max(both, threads) / max(h2d, d2h)
            rows.append(row(f"| {rows_kind} | {path.label} | {h2d:.1f} | {d2h:.1f} | {both:.1f} | "
                            f"{bench.pct(both, pinned.bidir)} | {threads:.1f} | "
                            f"{bench.pct(threads, pinned.bidir)} | {best:.2f}x |"))  # fmt: skip
        release()
    table(
        "Bidirectional: page 64, `layer_first`, per-layer loads and backups on two streams at once",
        "| rows | path | H2D alone GB/s | D2H alone GB/s | both at once, one issuing thread, GB/s | of "
        "pinned both | two issuing threads GB/s | of pinned both | best over the faster one way |",
        rows,
    )


def issue(args: argparse.Namespace, cuda: CudaDevice, pinned: bench.Pinned) -> None:
    rows: list[str] = []
    stream = bench.new_stream()
    for rows_kind, layout in (
        ("mla", "layer_first"),
        ("mha", "layer_first"),
        ("mha", "page_first"),
    ):
        world = bench.build_world(
            world_args(args, args.layers), bench.Case(rows_kind, 64, layout), cuda
        )
        path = triton(args.grids[0], args.tiles[0])
        if not checked(world, path, stream):
            rows.append(row(f"| {rows_kind} {layout} | BYTE MISMATCH | | | |"))
            continue
        with torch.cuda.stream(stream):
            bench.issue_loads(world, path)  # warm-up: plan and closures cached
        torch.cuda.synchronize()
        issue_us: list[float] = []
        profiler = cProfile.Profile()
        with torch.cuda.stream(stream):
            profiler.enable()
            bench.issue_loads(world, path, issue_us)
            profiler.disable()
        torch.cuda.synchronize()
        plain: list[float] = []
        with torch.cuda.stream(stream):
            bench.issue_loads(world, path, plain)
        torch.cuda.synchronize()
        layers = world.device_pool.layer_num
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.issue_top]
        parts = "; ".join(f"`{func[2]}` {stat[2] * 1e6 / layers:.1f}" for func, stat in top)
        rows.append(row(f"| {rows_kind} {layout} | {statistics.median(plain):.1f} | "
                        f"{statistics.median(issue_us):.1f} | {parts} |"))  # fmt: skip
        release()
    table(
        f"Issue: one layer's H2D through {triton(args.grids[0], args.tiles[0]).label}, page 64; "
        "`cProfile` over one per-layer load of every layer after a warm-up",
        "| rows, layout | us per layer (median, no profiler) | under cProfile | own time per layer "
        "under cProfile, us, by function (top) |",
        rows,
    )


RUNNERS: dict[str, Callable[[argparse.Namespace, CudaDevice, bench.Pinned], None]] = {
    "ceiling": ceiling, "span": span, "priority": priority, "wait": wait, "bidir": bidir,
    "issue": issue,
}  # fmt: skip


# ------------------------------------------------------------------ the run
def ints(text: str, what: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{what} {text!r}: give comma-separated integers such as 8,32")
    if any(v < 1 for v in values):
        parser.error(f"{what} {text!r}: every value must be >= 1")
    return values


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS))
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--mha-heads", type=int, default=4)
    parser.add_argument("--grids", default="8,32,132", help="ceiling: triton grids")
    parser.add_argument("--tiles", default="32x8", help="triton ROWSxWARPS, comma separated")
    parser.add_argument("--span-layers", default="2,16,32,61")
    parser.add_argument("--span-rows", default="mha,mla")
    parser.add_argument("--priority-grids", default="4,8")
    parser.add_argument("--bidir-grids", default="8,16,32")
    parser.add_argument("--bidir-rows", default="mla,mha")
    parser.add_argument("--issue-top", type=int, default=8)
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pinned-gib", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=int, default=540, help="print partial results, exit 1")
    parser.add_argument("--append", type=Path, help="append the tables to this markdown file")
    args = parser.parse_args(argv)
    args.experiments = args.experiments.split(",")
    unknown = [e for e in args.experiments if e not in EXPERIMENTS]
    if unknown:
        parser.error(f"--experiments: unknown {unknown}; choose from {','.join(EXPERIMENTS)}")
    if args.reps < 5:
        parser.error("--reps must be >= 5 (medians of at least five runs)")
    args.tiles = bench.parse_tiles(args.tiles, parser)
    args.grids = ints(args.grids, "--grids", parser)
    args.span_layers = ints(args.span_layers, "--span-layers", parser)
    args.priority_grids = ints(args.priority_grids, "--priority-grids", parser)
    args.bidir_grids = ints(args.bidir_grids, "--bidir-grids", parser)
    for option in ("span_rows", "bidir_rows"):
        kinds = getattr(args, option).split(",")
        if any(kind not in ("mla", "mha") for kind in kinds):
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} {','.join(kinds)!r}: choose from mla,mha")
        setattr(args, option, kinds)
    if args.tokens % 64:
        parser.error(f"--tokens {args.tokens} is not a multiple of page size 64")
    args.command = "python benchmarks/transfer_bounds.py " + " ".join(argv)
    return args


def emit(args: argparse.Namespace, header: str) -> None:
    title = f"## What bounds the Triton kernel (benchmarks/transfer_bounds.py), {time.strftime('%Y-%m-%d')}"
    text = "\n".join([f"\n{title}\n", header, *OUT, ""])
    say(text)
    if args.append is not None:
        with args.append.open("a", encoding="utf-8") as results:
            results.write(text)
        say(f"appended to {args.append}")


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        say("benchmarks/transfer_bounds.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    faulthandler.dump_traceback_later(args.timeout_s + 30, exit=True)  # hard stop on a hang
    cuda = CudaDevice()
    props = torch.cuda.get_device_properties(0)
    pinned = bench.measure_pinned(bench.parse(["--pinned-gib", str(args.pinned_gib)]))
    header = (
        f"Command: `{args.command}`  \nMachine: {props.name} ({props.multi_processor_count} SMs), "
        f"torch {torch.__version__}; {args.tokens} tokens per layer, bf16, bytes verified "
        f"against the gather path before timing, medians of {args.reps} after one warm-up.  \n"
        f"Pinned ~{args.pinned_gib:g} GiB copy, same run: H2D {pinned.h2d:.1f} GB/s, D2H "
        f"{pinned.d2h:.1f} GB/s, both at once {pinned.bidir:.1f} GB/s.\n"
    )
    say(header)
    deadline = time.perf_counter() + args.timeout_s
    status = 0
    for name in args.experiments:
        if time.perf_counter() > deadline:
            say(f"SOFT TIMEOUT: {name} and later experiments not run")
            status = 1
            break
        started = time.perf_counter()
        try:
            RUNNERS[name](args, cuda, pinned)
        except Exception:
            traceback.print_exc()
            OUT.append(f"\n{name}: failed (traceback in the run's output)")
            status = 1
        say(f"[{name}: {time.perf_counter() - started:.0f} s]")
    emit(args, header)
    return 1 if status or bench.FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
