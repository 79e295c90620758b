"""Paged host<->device KV transfers against one pinned copy: runs, batch (copy engine), triton,
and auto (the default: its row names the path it chose, ``pools/copy_choice.py``).

On one GPU, for each row kind (MLA rows of 576 bf16; MHA rows of ``--mha-heads`` x
``--head-dim`` bf16, K and V), page size and host layout, random page sets of ``--tokens`` tokens
over ``--layers`` layers, through the host pools' own API (``load_to_device_per_layer`` per
layer, ``backup_from_device_all_layer``):

- per-layer H2D and all-layer D2H GB/s of each copy path, and their share of one pinned
  ~1 GiB copy measured in the same run (``--pinned-gib``);
- CPU microseconds to issue one layer's H2D and one all-layer D2H (``time.perf_counter`` around
  the call only, median) and the first call's cost (it validates and plans; later layers reuse
  the plan); ``batch-inline`` is ``batch`` with the copier's issuing thread off (the runtime's
  call on the caller's thread, as before ``copy_issuer``); ``batch-layers`` and
  ``auto-layers`` load as the controller does (``load_to_device_layers``: all layers in one
  call, an event recorded after each; the issue column is then the call's CPU over its layers);
- bidirectional: per-layer loads and per-layer backups on two streams at once, against both
  pinned directions at once (``--bidir-cases``);
- the H2D beside a compute-bound bf16 matmul loop on a third stream: transfer GB/s and the
  matmul's slowdown.

Bytes are verified equal to the gather reference (computed on the GPU from a copy of the host
buffers) before anything is timed; a mismatch prints the first differing layer/row and exits 1.
CUDA events, one warm-up, medians of ``--reps`` (>= 5). ``--quick`` is a small smoke run
(< 60 s). Prints markdown tables and the command; ``--append FILE`` appends them.

    python benchmarks/transfer.py --quick
    python benchmarks/transfer.py --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hicache_ref.device import CudaDevice
from hicache_ref.pools import (
    HostKVCache,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
    make_host_pool,
)
from hicache_ref.pools.host_layout import host_row_index
from hicache_ref.pools.layer_records import LayerRecords
from hicache_ref.pools.transfer import PLAN_CACHE, copy_paths_for_layout
from hicache_ref.pools.triton_copy import (
    TRITON_ROWS_DEFAULT,
    TRITON_WARPS_DEFAULT,
    TritonLaunch,
    TritonTile,
    is_triton_available,
)

IO_BACKEND = {"layer_first": "direct", "page_first": "kernel", "page_first_direct": "direct",
              "layer_page_first": "direct", "page_head": "kernel"}  # fmt: skip
LINES: list[str] = []
FAILURES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)


@dataclass
class Case:
    rows: str
    page_size: int
    layout: str


@dataclass
class World:
    """One case's pools and its four disjoint index sets."""

    case: Case
    device_pool: KVCache
    host_pool: HostKVCache
    load_host: torch.Tensor  # host slots the loads read
    load_device: torch.Tensor  # device locs the loads write
    backup_device: torch.Tensor  # device locs the backups read
    backup_host: torch.Tensor  # host slots the backups write
    bytes_per_direction: int
    expected_load: list[dict[str, torch.Tensor]] = field(default_factory=list)


# ------------------------------------------------------------------ setup
def pages_to_locs(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)


def fill_random_bits(tensor: torch.Tensor, device: torch.device) -> None:
    """Random 16-bit patterns (generated on the GPU, copied in chunks: fast for pinned hosts)."""
    flat = tensor.view(-1).view(torch.int16)
    chunk = 1 << 28
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        values = torch.randint(-(2**15), 2**15, part.shape, dtype=torch.int16, device=device)
        part.copy_(values)


def build_world(args: argparse.Namespace, case: Case, cuda: CudaDevice) -> World:
    tokens, page = args.tokens, case.page_size
    pages = tokens // page
    # loads and backups use disjoint halves of both pools (they run at the same time)
    device_size = 2 * pages * page
    if case.rows == "mla":
        device_pool: KVCache = MLATokenToKVPool(
            device_size, page, torch.bfloat16, 512, 64, args.layers, cuda
        )
    else:
        device_pool = MHATokenToKVPool(
            device_size, page, torch.bfloat16, args.mha_heads, args.head_dim, args.layers, cuda
        )
    host_pool = make_host_pool(
        device_pool, layout=case.layout, size_tokens=2 * pages * page, copy_path="runs"
    )
    generator = torch.Generator().manual_seed(1234 + page)
    for name in device_pool.component_names():
        for layer in range(args.layers):
            fill_random_bits(device_pool.component_buffer(name, layer), cuda.device)
        fill_random_bits(host_pool.buffers[name], cuda.device)
    host_pages = torch.randperm(2 * pages, generator=generator)
    device_pages = torch.randperm(2 * pages, generator=generator)
    row_bytes = sum(math.prod(s) for s in device_pool.component_row_shapes().values()) * 2
    world = World(
        case=case,
        device_pool=device_pool,
        host_pool=host_pool,
        load_host=pages_to_locs(host_pages[:pages], page),
        load_device=pages_to_locs(device_pages[:pages], page),
        backup_device=pages_to_locs(device_pages[pages:], page),
        backup_host=pages_to_locs(host_pages[pages:], page),
        bytes_per_direction=args.layers * tokens * row_bytes,
    )
    torch.cuda.synchronize()
    world.expected_load = expected_rows(world, world.load_host)
    return world


def host_on_gpu(world: World) -> dict[str, torch.Tensor]:
    return {name: buffer.to("cuda") for name, buffer in world.host_pool.buffers.items()}


def expected_rows(world: World, host_slots: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer and component, the host rows at ``host_slots`` (gathered on the GPU)."""
    buffers = host_on_gpu(world)
    slots = host_slots.cuda()
    page = world.case.page_size
    rows = [
        {
            name: buffer[host_row_index(world.case.layout, layer, slots, page)].clone()  # type: ignore[arg-type]
            for name, buffer in buffers.items()
        }
        for layer in range(world.device_pool.layer_num)
    ]
    del buffers
    return rows


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


# ------------------------------------------------------------------ paths
@dataclass(frozen=True)
class Path_:
    name: str
    copy_path: str
    grid: int | None = None
    tile: tuple[int, int] | None = None
    """Triton: (rows per tile, warps)."""
    inline: bool = False
    """``batch``: issue on the caller's thread (the copier's issuing thread off)."""
    layers: bool = False
    """Load as the controller does: every layer in one ``load_to_device_layers`` call, an
    event recorded after each layer (``batch``/``auto``: one stepped entry of the issuing
    thread); otherwise one ``load_to_device_per_layer`` per layer, no event."""

    @property
    def label(self) -> str:
        if self.grid is None:
            return self.name
        rows, warps = self.tile or (TRITON_ROWS_DEFAULT, TRITON_WARPS_DEFAULT)
        return f"{self.name} grid {self.grid} tile {rows}x{warps}w"

    def context(self) -> Any:
        if self.inline:
            return inline_issue()
        return nullcontext()

    def triton(self) -> TritonLaunch:
        """The kernel's launch shape for this path (the host pool's ``triton_launch``)."""
        if self.grid is None:
            return TritonLaunch()
        rows, warps = self.tile or (TRITON_ROWS_DEFAULT, TRITON_WARPS_DEFAULT)
        return TritonLaunch(self.grid, TritonTile(rows, warps))


@contextmanager
def inline_issue() -> Iterator[None]:
    """``batch`` issued on the caller's thread within the block (the pre-issuer behaviour)."""
    from hicache_ref.pools.copy_engine import load_cuda_batch_copier

    copier = load_cuda_batch_copier()
    saved, copier.threaded = copier.threaded, False
    try:
        yield
    finally:
        copier.threaded = saved


LAYER_EVENTS: dict[int, LayerRecords] = {}
"""The per-layer events of ``Path_.layers`` loads, by layer count (made once)."""


def issue_loads(
    world: World,
    path: Path_,
    issue_us: list[float] | None = None,
    op_us: list[float] | None = None,
) -> None:
    """Every layer's H2D of one load. With ``op_us``: as a controller's new load operation
    issues it, on index tensors never seen before (fresh copies of the same indices, so the
    first layer checks and plans), and the whole load's CPU over its layers is appended."""
    host_pool, device_pool = world.host_pool, world.device_pool
    host_pool.copy_path = path.copy_path  # type: ignore[assignment]
    host_pool.triton_launch = path.triton()
    backend = IO_BACKEND[world.case.layout]
    host, device = world.load_host, world.load_device
    if op_us is not None:
        host, device = host.clone(), device.clone()
    with path.context():
        op_start = time.perf_counter()
        if path.layers:
            records = LAYER_EVENTS.get(device_pool.layer_num)
            if records is None:  # the controller's shape: one event per layer, kept with its slot
                events = [new_event(timing=False) for _ in range(device_pool.layer_num)]
                records = LayerRecords({layer: (event,) for layer, event in enumerate(events)})
                LAYER_EVENTS[device_pool.layer_num] = records
            host_pool.load_to_device_layers(
                device_pool, host, device, range(device_pool.layer_num), backend, records
            )
            elapsed = (time.perf_counter() - op_start) * 1e6 / device_pool.layer_num
            if issue_us is not None:
                issue_us.append(elapsed)
            if op_us is not None:
                op_us.append(elapsed)
            return
        for layer in range(device_pool.layer_num):
            start = time.perf_counter()
            host_pool.load_to_device_per_layer(device_pool, host, device, layer, backend)
            if issue_us is not None:
                issue_us.append((time.perf_counter() - start) * 1e6)
        if op_us is not None:
            op_us.append((time.perf_counter() - op_start) * 1e6 / device_pool.layer_num)


def issue_backup(
    world: World, path: Path_, *, per_layer: bool = False, issue_us: list[float] | None = None
) -> None:
    host_pool, device_pool = world.host_pool, world.device_pool
    host_pool.copy_path = path.copy_path  # type: ignore[assignment]
    host_pool.triton_launch = path.triton()
    backend = IO_BACKEND[world.case.layout]
    with path.context():
        if not per_layer:
            start = time.perf_counter()
            host_pool.backup_from_device_all_layer(
                device_pool, world.backup_host, world.backup_device, backend
            )
            if issue_us is not None:
                issue_us.append((time.perf_counter() - start) * 1e6)
            return
        for layer in range(device_pool.layer_num):
            host_pool.backup_from_device_per_layer(
                device_pool, world.backup_host, world.backup_device, layer, backend
            )


def fail(message: str) -> None:
    say(f"BYTE MISMATCH: {message}")
    FAILURES.append(message)


def verify(world: World, path: Path_, stream: torch.cuda.Stream) -> bool:
    """Run one load and one backup of ``path`` into scrambled destinations and compare every
    moved row with the gather reference (this also compiles and warms the path)."""
    device_pool = world.device_pool
    load_locs, backup_locs = world.load_device.cuda(), world.backup_device.cuda()
    for name in device_pool.component_names():
        for layer in range(device_pool.layer_num):
            buffer = device_pool.component_buffer(name, layer)
            buffer[load_locs] = 0
            # fresh source bytes for the backup, so stale host rows of another path cannot pass
            shape = (backup_locs.numel(), *buffer.shape[1:])
            fresh = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=buffer.device)
            buffer[backup_locs] = fresh.view(buffer.dtype)
    torch.cuda.synchronize()
    PLAN_CACHE.clear()
    with torch.cuda.stream(stream):
        issue_loads(world, path)
        issue_backup(world, path)
    stream.synchronize()
    ok = True
    for layer in range(device_pool.layer_num):
        for name in device_pool.component_names():
            got = device_pool.component_buffer(name, layer)[world.load_device.cuda()]
            if not torch.equal(bits(got), bits(world.expected_load[layer][name])):
                fail(f"{world.case} {path.label} h2d layer {layer} component {name}")
                ok = False
                break
    backed = expected_rows(world, world.backup_host)
    for layer in range(device_pool.layer_num):
        for name in device_pool.component_names():
            source = device_pool.component_buffer(name, layer)[world.backup_device.cuda()]
            if not torch.equal(bits(backed[layer][name]), bits(source)):
                fail(f"{world.case} {path.label} d2h layer {layer} component {name}")
                ok = False
                break
    return ok


# ------------------------------------------------------------------ timing
def time_on_stream(stream: torch.cuda.Stream, issue: Callable[[], object]) -> float:
    """Milliseconds between events recorded around ``issue`` on ``stream``."""
    start = new_event()
    end = new_event()
    with torch.cuda.stream(stream):
        start.record(stream)
        issue()
        end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end))


def median_ms(reps: int, measure: Callable[[], float]) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(reps))


def time_pair(
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    issue_a: Callable[[], object] = lambda: None,
    issue_b: Callable[[], object] = lambda: None,
    *,
    interleave: Callable[[], Iterator[None]] | None = None,
) -> float:
    """Milliseconds from a common start to the later of two streams' ends."""
    a, b = streams
    start = new_event()
    end = new_event()
    b_done = new_event(timing=False)
    torch.cuda.synchronize()
    start.record(a)
    b.wait_event(start)
    if interleave is not None:
        for _ in interleave():
            pass
    else:
        with torch.cuda.stream(a):
            issue_a()
        with torch.cuda.stream(b):
            issue_b()
    b_done.record(b)
    a.wait_event(b_done)
    end.record(a)
    end.synchronize()
    return float(start.elapsed_time(end))


@dataclass
class Pinned:
    h2d: float
    d2h: float
    bidir: float
    nbytes: int


def measure_pinned(args: argparse.Namespace) -> Pinned:
    nbytes = int(args.pinned_gib * (1 << 30))
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    s1, s2 = new_stream(), new_stream()
    h2d = median_ms(
        args.reps, lambda: time_on_stream(s1, lambda: device[0].copy_(host[0], non_blocking=True))
    )
    d2h = median_ms(
        args.reps, lambda: time_on_stream(s1, lambda: host[1].copy_(device[1], non_blocking=True))
    )
    both = median_ms(
        args.reps,
        lambda: time_pair(
            (s1, s2),
            lambda: device[0].copy_(host[0], non_blocking=True),
            lambda: host[1].copy_(device[1], non_blocking=True),
        ),
    )
    return Pinned(gbps(nbytes, h2d), gbps(nbytes, d2h), gbps(2 * nbytes, both), nbytes)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def pct(value: float, ceiling: float) -> str:
    return f"{100 * value / ceiling:.0f}%"


# ------------------------------------------------------------------ matmul
@dataclass
class Matmul:
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    one_ms: float

    def loop(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.c)


def make_matmul(size: int, stream: torch.cuda.Stream) -> Matmul:
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    matmul = Matmul(a, b, torch.empty_like(a), 0.0)
    matmul.one_ms = median_ms(3, lambda: time_on_stream(stream, lambda: matmul.loop(4))) / 4
    return matmul


# ------------------------------------------------------------------ the run
def run(args: argparse.Namespace) -> int:
    cuda = CudaDevice()
    props = torch.cuda.get_device_properties(0)
    paths = [Path_(name, name) for name in args.paths if name in ("runs", "batch")]
    if "batch-inline" in args.paths:
        paths.append(Path_("batch inline", "batch", inline=True))
    if "triton" in args.paths:
        if is_triton_available():
            paths += [
                Path_("triton", "triton", grid, tile) for tile in args.tiles for grid in args.grids
            ]
        else:
            say("triton is not installed: skipping the triton paths")
    if "auto" in args.paths:
        paths.append(Path_("auto", "auto"))  # the default: its row names the path it chose
    for name in ("batch", "auto"):
        if f"{name}-layers" in args.paths:
            paths.append(Path_(f"{name} layers", name, layers=True))
    copier_line = ""
    if any(p.copy_path == "batch" for p in paths):
        from hicache_ref.pools.copy_engine import load_cuda_batch_copier

        copier = load_cuda_batch_copier()
        copier_line = f", cudart {copier.runtime_version} ({os.path.basename(copier.path)})"
    triton_version = ""
    if is_triton_available():
        import importlib

        triton_version = f", triton {importlib.import_module('triton').__version__}"
    machine = (
        f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}{copier_line}{triton_version}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    say(f"machine: {machine}")
    started = time.perf_counter()
    pinned = measure_pinned(args)
    say(f"pinned {pinned.nbytes >> 20} MiB: h2d {pinned.h2d:.1f} GB/s, d2h {pinned.d2h:.1f} GB/s, "
        f"both at once {pinned.bidir:.1f} GB/s  [{time.perf_counter() - started:.1f} s]")  # fmt: skip
    results = Results()
    main_rows, bidir_rows, overlap_rows = results.main, results.bidir, results.overlap
    header = (
        f"Command: `{args.command}`  \nMachine: {machine}  \n"
        f"{args.tokens} tokens x {args.layers} layers per direction, random pages, bf16; MLA rows "
        f"576 elements (1,152 B), MHA rows {args.mha_heads}x{args.head_dim} for K and V; CPU index "
        f"tensors; medians of {args.reps} after one warm-up; bytes verified before timing; "
        f"`runs` timed at page sizes {sorted(args.runs_page_sizes)} only.  \n"
        f"Pinned ~{args.pinned_gib:g} GiB copy, same run: H2D {pinned.h2d:.1f} GB/s, D2H "
        f"{pinned.d2h:.1f} GB/s, both directions at once {pinned.bidir:.1f} GB/s total.\n"
    )
    LINES.append(header)

    def tables() -> str:
        out = [
            "| rows | page | layout | path | H2D per layer GB/s | of pinned | D2H all layers GB/s "
            "| of pinned | H2D issue µs/layer (median) | new load op: H2D issue µs/layer "
            "(mean over its layers, median over ops) | D2H issue µs, all layers (median) "
            "| first call µs |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *main_rows,
        ]
        auto_rows = results.auto_rows()
        if auto_rows:
            out += ["", "| rows | page | layout | auto took | best other H2D | auto of it | "
                    "best other D2H | auto of it |", "|---|---:|---|---|---|---:|---|---:|",
                    *auto_rows]  # fmt: skip
        if bidir_rows:
            out += ["", "| rows | page | layout | path | load + backup at once GB/s | of pinned both |",
                    "|---|---:|---|---|---:|---:|", *bidir_rows]  # fmt: skip
        if overlap_rows:
            out += ["", "| rows | page | layout | path | H2D beside matmul GB/s | of pinned | matmul "
                    "ms alone | beside | slowdown |", "|---|---:|---|---|---:|---:|---:|---:|---:|",
                    *overlap_rows]  # fmt: skip
        return "\n".join(out)

    def on_alarm(signum: int, frame: Any) -> None:
        say(f"\nSOFT TIMEOUT after {args.timeout_s} s: partial results follow")
        emit(args, header, tables())
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout_s)
    streams = Streams(new_stream(), new_stream(), new_stream())
    matmul = make_matmul(args.matmul_size, streams.compute) if args.overlap else None
    for rows in args.rows:
        for page_size in args.page_sizes:
            for layout in args.layouts:
                case = Case(rows, page_size, layout)
                t0 = time.perf_counter()
                world = build_world(args, case, cuda)
                say(f"\n{rows} page {page_size} {layout}: "
                    f"{world.bytes_per_direction / 1e9:.2f} GB per direction "
                    f"[setup {time.perf_counter() - t0:.1f} s]")  # fmt: skip
                subset = f"{rows}:{page_size}:{layout}" in args.bidir_cases
                for path in paths:
                    if (
                        resolved_path(world, path) == "runs"
                        and page_size not in args.runs_page_sizes
                    ):
                        continue
                    if path.copy_path not in copy_paths_for_layout(layout):
                        say(f"{path.label}: refused for {layout} (BATCH_REFUSED_LAYOUTS)")
                        continue
                    measure_path(world, path, streams, pinned, args, subset, matmul, results)
                del world
                PLAN_CACHE.clear()
                torch.cuda.empty_cache()
    signal.alarm(0)
    say(f"\ntotal {time.perf_counter() - started:.0f} s")
    emit(args, header, tables())
    if FAILURES:
        say(f"{len(FAILURES)} FAILURE(S):")
        for failure in FAILURES:
            say(f"  {failure}")
        return 1
    return 0


@dataclass
class Results:
    main: list[str] = field(default_factory=list)
    bidir: list[str] = field(default_factory=list)
    overlap: list[str] = field(default_factory=list)
    rates: dict[tuple[str, int, str], dict[str, tuple[float, float]]] = field(default_factory=dict)
    """Per case (rows, page, layout): each timed path's label -> (H2D, D2H) GB/s."""

    def auto_rows(self) -> list[str]:
        """Per case with an ``auto`` row: auto against the best other path, per direction."""
        rows = []
        for (kind, page, layout), rates in self.rates.items():
            auto = [label for label in rates if label.startswith("auto")]
            others = {label: rate for label, rate in rates.items() if not label.startswith("auto")}
            if not auto or not others:
                continue
            h2d, d2h = rates[auto[0]]
            best_h2d = max(others.items(), key=lambda item: item[1][0])
            best_d2h = max(others.items(), key=lambda item: item[1][1])
            rows.append(
                f"| {kind} | {page} | {layout} | {auto[0]} | {best_h2d[0]} | "
                f"{pct(h2d, best_h2d[1][0])} | {best_d2h[0]} | {pct(d2h, best_d2h[1][1])} |"
            )
        return rows


@dataclass
class Streams:
    load: torch.cuda.Stream
    write: torch.cuda.Stream
    compute: torch.cuda.Stream


def new_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def new_event(*, timing: bool = True) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def resolved_path(world: World, path: Path_) -> str:
    """The copy path ``path`` runs for these pools: ``auto`` is asked of the host pool
    (``copy_choice``), never assumed."""
    if path.copy_path != "auto":
        return path.copy_path
    return world.host_pool.auto_copy_path(world.device_pool)


def row_label(world: World, path: Path_) -> str:
    """The path's label; ``auto`` also names the path it resolved to, e.g. ``auto (batch)``
    or ``auto layers (batch)``."""
    if path.copy_path != "auto":
        return path.label
    return f"{path.name} ({world.host_pool.describe_auto_copy_path(world.device_pool)})"


def measure_path(
    world: World,
    path: Path_,
    streams: Streams,
    pinned: Pinned,
    args: argparse.Namespace,
    subset: bool,
    matmul: Matmul | None,
    results: Results,
) -> None:
    """Verify one path's bytes, then time it (and, for the subset cases, bidir and overlap)."""
    case = world.case
    lead = f"| {case.rows} | {case.page_size} | {case.layout} | {row_label(world, path)} |"
    started = time.perf_counter()
    try:
        ok = verify(world, path, streams.load)
    except Exception as error:  # a path that cannot run is a result, loudly
        traceback.print_exc()
        FAILURES.append(f"{case} {path.label}: {type(error).__name__}: {error}")
        results.main.append(f"{lead} error: {type(error).__name__} | | | | | | | |")
        return
    if not ok:
        results.main.append(f"{lead} BYTE MISMATCH | | | | | | | |")
        return
    # the first layer of a new transfer validates and plans; later layers reuse the plan
    PLAN_CACHE.clear()
    streams.load.synchronize()
    with torch.cuda.stream(streams.load):
        plan_us: list[float] = []
        with path.context():
            world.host_pool.copy_path = path.copy_path  # type: ignore[assignment]
            world.host_pool.triton_launch = path.triton()
            start = time.perf_counter()
            world.host_pool.load_to_device_per_layer(
                world.device_pool, world.load_host, world.load_device, 0,
                IO_BACKEND[case.layout],
            )  # fmt: skip
            plan_us.append((time.perf_counter() - start) * 1e6)
    streams.load.synchronize()
    first_us = plan_us[0]
    issue_us: list[float] = []

    def loads() -> float:
        return time_on_stream(streams.load, lambda: issue_loads(world, path, issue_us))

    backup_us: list[float] = []

    def backup() -> float:
        return time_on_stream(streams.write, lambda: issue_backup(world, path, issue_us=backup_us))

    h2d_ms = median_ms(args.reps, loads)
    d2h_ms = median_ms(args.reps, backup)
    op_us: list[float] = []
    for _ in range(args.reps):  # new operations: fresh index tensors, timed on the CPU only
        with torch.cuda.stream(streams.load):
            issue_loads(world, path, op_us=op_us)
        streams.load.synchronize()
    h2d = gbps(world.bytes_per_direction, h2d_ms)
    d2h = gbps(world.bytes_per_direction, d2h_ms)
    key = (case.rows, case.page_size, case.layout)
    results.rates.setdefault(key, {})[row_label(world, path)] = (h2d, d2h)
    results.main.append(
        f"{lead} {h2d:.1f} | {pct(h2d, pinned.h2d)} | {d2h:.1f} | {pct(d2h, pinned.d2h)} | "
        f"{statistics.median(issue_us):.1f} | {statistics.median(op_us):.1f} | "
        f"{statistics.median(backup_us):.0f} | "
        f"{first_us:.0f} |"
    )
    say(results.main[-1] + f"  [{time.perf_counter() - started:.1f} s]")
    subset = subset and path.name.replace(" ", "-") in args.subset_paths
    subset = subset and (path.grid is None or path.grid in args.subset_grids)
    if subset and args.bidir:

        def both_ways() -> float:
            return time_pair(
                (streams.load, streams.write),
                interleave=lambda: interleaved(world, path, streams.load, streams.write),
            )

        both = gbps(2 * world.bytes_per_direction, median_ms(args.reps, both_ways))
        results.bidir.append(f"{lead} {both:.1f} | {pct(both, pinned.bidir)} |")
        say(results.bidir[-1])
    if subset and matmul is not None:
        results.overlap.append(
            overlap(world, path, matmul, streams.load, streams.compute, h2d_ms, pinned, args)
        )
        say(results.overlap[-1])


def interleaved(
    world: World, path: Path_, load_stream: torch.cuda.Stream, write_stream: torch.cuda.Stream
) -> Iterator[None]:
    """Per-layer loads on one stream and per-layer backups on another, issued alternately."""
    host_pool, device_pool = world.host_pool, world.device_pool
    host_pool.copy_path = path.copy_path  # type: ignore[assignment]
    host_pool.triton_launch = path.triton()
    backend = IO_BACKEND[world.case.layout]
    with path.context():
        for layer in range(device_pool.layer_num):
            with torch.cuda.stream(load_stream):
                host_pool.load_to_device_per_layer(
                    device_pool, world.load_host, world.load_device, layer, backend
                )
            with torch.cuda.stream(write_stream):
                host_pool.backup_from_device_per_layer(
                    device_pool, world.backup_host, world.backup_device, layer, backend
                )
            yield


def overlap(
    world: World,
    path: Path_,
    matmul: Matmul,
    load_stream: torch.cuda.Stream,
    compute_stream: torch.cuda.Stream,
    h2d_ms: float,
    pinned: Pinned,
    args: argparse.Namespace,
) -> str:
    """The H2D beside a matmul loop long enough to cover it (both timed by their own events)."""
    count = max(4, math.ceil(1.5 * h2d_ms / matmul.one_ms))
    alone = median_ms(args.reps, lambda: time_on_stream(compute_stream, lambda: matmul.loop(count)))
    transfer_ms: list[float] = []
    matmul_ms: list[float] = []
    for _ in range(args.reps + 1):
        events = [new_event() for _ in range(4)]
        torch.cuda.synchronize()
        events[0].record(compute_stream)
        with torch.cuda.stream(compute_stream):
            matmul.loop(count)
        events[1].record(compute_stream)
        events[2].record(load_stream)
        with torch.cuda.stream(load_stream):
            issue_loads(world, path)
        events[3].record(load_stream)
        torch.cuda.synchronize()
        matmul_ms.append(events[0].elapsed_time(events[1]))
        transfer_ms.append(events[2].elapsed_time(events[3]))
    beside_transfer = statistics.median(transfer_ms[1:])
    beside_matmul = statistics.median(matmul_ms[1:])
    h2d = gbps(world.bytes_per_direction, beside_transfer)
    case = world.case
    return (f"| {case.rows} | {case.page_size} | {case.layout} | {path.label} | {h2d:.1f} | "
            f"{pct(h2d, pinned.h2d)} | {alone:.1f} | {beside_matmul:.1f} | "
            f"{beside_matmul / alone:.2f}x |")  # fmt: skip


def emit(args: argparse.Namespace, header: str, table: str) -> None:
    title = f"## Paged transfers vs one pinned copy (benchmarks/transfer.py), {time.strftime('%Y-%m-%d')}"
    text = f"\n{title}\n\n{header}\n{table}\n"
    say(text)
    if args.append is not None:
        with args.append.open("a", encoding="utf-8") as results:
            results.write(text)
        say(f"appended to {args.append}")


def parse_tiles(text: str, parser: argparse.ArgumentParser) -> list[tuple[int, int]]:
    """``ROWSxWARPS,...`` as (rows, warps) pairs, or one ``parser.error`` line."""
    try:
        tiles = [tuple(int(v) for v in tile.split("x")) for tile in text.split(",")]
    except ValueError:
        tiles = []
    if not tiles or any(len(tile) != 2 for tile in tiles):
        parser.error(f"--tiles {text!r}: give ROWSxWARPS pairs such as 32x8,1x4")
    return [(rows, warps) for rows, warps in tiles]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (< 60 s)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--rows", default="mla,mha", help="comma list of mla, mha")
    parser.add_argument("--mha-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--layouts", default="layer_first,page_first")
    parser.add_argument("--paths", default="runs,batch,triton,auto",
                        help="copy paths to time; auto is the default path, its row names "
                        "what it chose; batch-inline is batch issued on the caller's thread "
                        "(no issuing thread); batch-layers and auto-layers load all layers "
                        "in one call as the controller does")  # fmt: skip
    parser.add_argument("--runs-page-sizes", default="64",
                        help="page sizes that time the slow reference path 'runs' (page 16 adds "
                        "~4 min to a full run)")  # fmt: skip
    parser.add_argument("--grids", default="8,32,132", help="triton persistent grid sizes")
    parser.add_argument("--tiles", default=f"{TRITON_ROWS_DEFAULT}x{TRITON_WARPS_DEFAULT}",
                        help="triton tiles as ROWSxWARPS, comma separated (1x4: one row at a "
                        "time, the first kernel)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pinned-gib", type=float, default=1.0)
    parser.add_argument("--bidir-cases", default="mla:64:layer_first,mha:64:layer_first",
                        help="rows:page:layout cases that also run bidirectional and overlap")  # fmt: skip
    parser.add_argument("--subset-paths", default="batch,triton",
                        help="paths that run the bidirectional and overlap measurements")  # fmt: skip
    parser.add_argument("--subset-grids", default="32,132",
                        help="triton grids that run the bidirectional and overlap measurements")  # fmt: skip
    parser.add_argument("--no-bidir", dest="bidir", action="store_false")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--timeout-s", type=int, default=540, help="print partial results, exit 1")
    parser.add_argument("--append", type=Path, help="append the tables to this markdown file")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.layers = min(args.tokens, 4096), min(args.layers, 8)
        args.page_sizes, args.grids, args.pinned_gib = "64", "32,132", min(args.pinned_gib, 0.25)
        args.matmul_size = min(args.matmul_size, 4096)
    # Verify sizes that split into whole pages and the required number of repetitions
    if args.reps < 5:
        parser.error("--reps must be >= 5 (medians of at least five runs)")
    args.rows = args.rows.split(",")
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    args.layouts = args.layouts.split(",")
    args.paths = args.paths.split(",")
    args.grids = [int(g) for g in args.grids.split(",")]
    args.tiles = parse_tiles(args.tiles, parser)
    args.runs_page_sizes = {int(p) for p in args.runs_page_sizes.split(",")}
    args.bidir_cases = set(args.bidir_cases.split(","))
    args.subset_paths = set(args.subset_paths.split(","))
    args.subset_grids = {int(g) for g in args.subset_grids.split(",")}
    for page in args.page_sizes:
        if args.tokens % page:
            parser.error(f"--tokens {args.tokens} is not a multiple of page size {page}")
    args.command = "python benchmarks/transfer.py " + " ".join(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        say("benchmarks/transfer.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    faulthandler.dump_traceback_later(args.timeout_s + 30, exit=True)  # hard stop on a hang
    try:
        return run(args)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
