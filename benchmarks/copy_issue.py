"""What one layer's copy-engine issue costs on the CPU, and the ways around the runtime's price.

Raw ``ctypes`` calls on precomputed descriptor arrays (no pool, no plan: the floor under any
Python on top), MLA rows (1,152 B), page 64 (73,728-byte page copies), random pages, a
``layer_first`` host buffer and one device allocation for all layers:

- ``batch N``: one ``cudaMemcpyBatchAsync`` of N page copies (N = 1 ... 512): CPU per call;
  at N = 512 per layer, the GPU rate of 61 layers against a pinned 1 GiB copy;
- ``batch all layers``: the 61 layers' 31,232 copies in one call;
- ``3d batch``: ``cudaMemcpy3DBatchAsync`` with one op per page spanning every layer (height =
  layers, each side's row pitch = its layer stride): an all-layer backup in 512 ops;
- ``graph``: each layer's batch captured into a CUDA graph; capture, instantiate and launch
  cost, and the GPU rate of the 61 launches;
- ``issuer thread``: the caller records an event and enqueues a stream wait on a counter
  (``cuStreamWaitValue64``); a thread issues the batch on a side stream that waits the event,
  then writes the counter (``cuStreamWriteValue64``): the caller's cost per layer.

Bytes are verified against a gather of the host rows before anything is timed (each method
writes into zeroed destinations first); CUDA events for GPU time, ``perf_counter_ns`` around
each call for CPU, medians. Prints one markdown table; ``--append FILE`` appends it.

    python benchmarks/copy_issue.py --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from hicache_ref.pools.copy_engine import (
    CUDA_MEM_LOCATION_TYPE_DEVICE,
    CUDA_MEM_LOCATION_TYPE_HOST,
    _MemLocation,
    load_cuda_batch_copier,
)

ROWS: list[str] = []
FAILURES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)


class Operand(ctypes.Structure):
    """``cudaMemcpy3DOperand`` with the pointer member of its union (40 bytes)."""

    _fields_ = (
        ("type", ctypes.c_int),
        ("ptr", ctypes.c_void_p),
        ("rowLength", ctypes.c_size_t),
        ("layerHeight", ctypes.c_size_t),
        ("locHint", _MemLocation),
    )


class Batch3DOp(ctypes.Structure):
    """``cudaMemcpy3DBatchOp`` (112 bytes)."""

    _fields_ = (
        ("src", Operand),
        ("dst", Operand),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
        ("depth", ctypes.c_size_t),
        ("srcAccessOrder", ctypes.c_int),
        ("flags", ctypes.c_uint),
    )


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        self.layers = args.layers
        self.tokens = args.tokens
        self.page = args.page_size
        self.row = args.row_bytes
        self.page_bytes = self.page * self.row
        self.slots = 2 * self.tokens  # host and device pools twice the transfer
        self.pages_total = self.slots // self.page
        self.n = self.tokens // self.page  # page copies per layer
        self.host = torch.empty(
            (self.layers, self.slots, self.row), dtype=torch.uint8, pin_memory=True
        )
        self.dev = torch.empty(
            (self.layers, self.slots, self.row), dtype=torch.uint8, device="cuda"
        )
        for layer in range(self.layers):
            self.dev[layer].random_(0, 256)
            self.host[layer].copy_(torch.randint(0, 256, (self.slots, self.row), dtype=torch.uint8,
                                                 device="cuda"))  # fmt: skip
        gen = torch.Generator().manual_seed(7)
        hp = torch.randperm(self.pages_total, generator=gen)
        dp = torch.randperm(self.pages_total, generator=gen)
        self.load_h, self.load_d = hp[: self.n], dp[: self.n]
        self.back_h, self.back_d = hp[self.n :], dp[self.n :]
        self.host_ls = self.slots * self.row
        self.dev_ls = self.slots * self.row
        self.host_ptr = self.host.data_ptr()
        self.dev_ptr = self.dev.data_ptr()
        torch.cuda.synchronize()
        # expected rows of a load, gathered on the GPU from a device copy of the host pages
        hview = self.host.view(self.layers, self.pages_total, self.page_bytes)
        self.expect_load = hview[:, self.load_h].cuda()

    def arrays(
        self, h2d: bool, host_pages: torch.Tensor, dev_pages: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[layers, n] int64 dsts, srcs, sizes (numpy, C order): every layer at once."""
        layer = np.arange(self.layers, dtype=np.int64)[:, None]
        hp = host_pages.numpy().astype(np.int64)[None, :]
        dp = dev_pages.numpy().astype(np.int64)[None, :]
        host = self.host_ptr + layer * self.host_ls + hp * self.page_bytes
        dev = self.dev_ptr + layer * self.dev_ls + dp * self.page_bytes
        sizes = np.full(host.shape, self.page_bytes, dtype=np.int64)
        dsts, srcs = (dev, host) if h2d else (host, dev)
        return np.ascontiguousarray(dsts), np.ascontiguousarray(srcs), sizes

    def clear_load(self) -> None:
        self.dev.view(self.layers, self.pages_total, self.page_bytes)[:, self.load_d] = 0
        torch.cuda.synchronize()

    def verify_load(self, what: str) -> bool:
        torch.cuda.synchronize()
        got = self.dev.view(self.layers, self.pages_total, self.page_bytes)[:, self.load_d]
        if not torch.equal(got, self.expect_load):
            bad = [k for k in range(self.layers) if not torch.equal(got[k], self.expect_load[k])]
            FAILURES.append(f"{what}: layers {bad[:5]} differ")
            say(f"BYTE MISMATCH {what}: layers {bad[:5]}")
            return False
        return True

    def clear_backup(self) -> None:
        self.host.view(self.layers, self.pages_total, self.page_bytes)[:, self.back_h] = 0

    def verify_backup(self, what: str) -> bool:
        torch.cuda.synchronize()
        got = self.host.view(self.layers, self.pages_total, self.page_bytes)[:, self.back_h]
        want = self.dev.view(self.layers, self.pages_total, self.page_bytes)[:, self.back_d].cpu()
        if not torch.equal(got, want):
            FAILURES.append(f"{what}: backup differs")
            say(f"BYTE MISMATCH {what}")
            return False
        return True


def new_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def timed(stream: torch.cuda.Stream, issue: Callable[[], list[int]]) -> tuple[float, list[int]]:
    """GPU ms between events around ``issue`` on ``stream``, and the CPU ns it reports."""
    start, end = new_event(), new_event()
    torch.cuda.synchronize()
    start.record(stream)
    cpu = issue()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), cpu


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--row-bytes", type=int, default=1152)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--append", type=Path)
    parser.add_argument("--timeout-s", type=int, default=240)
    parser.add_argument("--skip", default="", help="comma list of methods to skip")
    args = parser.parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # a hung stream wait ends here
    copier = load_cuda_batch_copier()
    lib = copier.library
    batch = copier._function
    attr_h2d = copier.attributes(d2h=False, device_index=0)
    attr_d2h = copier.attributes(d2h=True, device_index=0)
    idx = (ctypes.c_size_t * 1)(0)
    v13 = copier.runtime_version >= 13000
    t0 = time.perf_counter()
    s = Setup(args)
    say(f"setup {time.perf_counter() - t0:.1f} s; {torch.cuda.get_device_name()} torch "
        f"{torch.__version__} cudart {copier.runtime_version}")  # fmt: skip
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    handle = stream.cuda_stream
    total = s.layers * s.n * s.page_bytes

    # pinned reference, same run
    ph = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pd = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        ms = [timed(stream, lambda: (pd.copy_(ph, non_blocking=True), [])[1])[0] for _ in range(6)]
        pin_h2d = gbps(1 << 30, statistics.median(ms[1:]))
        ms = [timed(stream, lambda: (ph.copy_(pd, non_blocking=True), [])[1])[0] for _ in range(6)]
    pin_d2h = gbps(1 << 30, statistics.median(ms[1:]))
    say(f"pinned 1 GiB: h2d {pin_h2d:.1f} GB/s, d2h {pin_d2h:.1f} GB/s")

    dl, sl, zl = s.arrays(True, s.load_h, s.load_d)
    db, sb, zb = s.arrays(False, s.back_h, s.back_d)
    row_stride = s.n * 8

    def batch_call(d: np.ndarray, sr: np.ndarray, z: np.ndarray, off: int, count: int,
                   attrs: ctypes.Structure, strm: int) -> None:  # fmt: skip
        tail = [] if v13 else [None]
        code = batch(d.ctypes.data + off, sr.ctypes.data + off, z.ctypes.data + off, count,
                     ctypes.addressof(attrs), ctypes.addressof(idx), 1, *tail, strm)  # fmt: skip
        check(code, "cudaMemcpyBatchAsync")

    def per_layer(count: int, h2d: bool = True, strm: int | None = None) -> Callable[[], list[int]]:
        d, sr, z = (dl, sl, zl) if h2d else (db, sb, zb)
        attrs = attr_h2d if h2d else attr_d2h
        target = handle if strm is None else strm

        def issue() -> list[int]:
            out = []
            for layer in range(s.layers):
                t = time.perf_counter_ns()
                batch_call(d, sr, z, layer * row_stride, count, attrs, target)
                out.append(time.perf_counter_ns() - t)
            return out

        return issue

    def row(method: str, cpu_us: float, cpu_what: str, gb: float | None, ref: float) -> None:
        rate = "-" if gb is None else f"{gb:.1f}"
        share = "-" if gb is None else f"{100 * gb / ref:.0f}%"
        ROWS.append(f"| {method} | {cpu_us:.1f} | {cpu_what} | {rate} | {share} |")
        say(ROWS[-1])

    # ---------------------------------------------------------------- batch per layer
    s.clear_load()
    per_layer(s.n)()
    if s.verify_load("batch 512 h2d"):
        for count in (1, 8, 64, 256, s.n):
            runs = [timed(stream, per_layer(count)) for _ in range(args.reps + 1)][1:]
            cpu = statistics.median(ns for _, c in runs for ns in c) / 1e3
            gb = gbps(total, statistics.median(m for m, _ in runs)) if count == s.n else None
            row(f"batch {count} copies, h2d, per layer", cpu, "µs per call", gb, pin_h2d)
    s.clear_backup()
    per_layer(s.n, h2d=False)()
    if s.verify_backup("batch 512 d2h"):
        runs = [timed(stream, per_layer(s.n, h2d=False)) for _ in range(args.reps + 1)][1:]
        cpu = statistics.median(sum(c) for _, c in runs) / 1e3
        gb = gbps(total, statistics.median(m for m, _ in runs))
        row(f"batch {s.n} copies per layer, d2h, all {s.layers} layers", cpu, "µs all layers",
            gb, pin_d2h)  # fmt: skip

    if "onecall" not in skip:

        def one_call() -> list[int]:
            t = time.perf_counter_ns()
            batch_call(db, sb, zb, 0, s.n * s.layers, attr_d2h, handle)
            return [time.perf_counter_ns() - t]

        s.clear_backup()
        one_call()
        if s.verify_backup("batch one call d2h"):
            runs = [timed(stream, one_call) for _ in range(args.reps + 1)][1:]
            cpu = statistics.median(c[0] for _, c in runs) / 1e3
            gb = gbps(total, statistics.median(m for m, _ in runs))
            row(f"batch all {s.layers * s.n} copies in one call, d2h", cpu, "µs all layers", gb,
                pin_d2h)  # fmt: skip

    # ---------------------------------------------------------------- 3d batch
    if "3d" not in skip:
        f3d = lib.cudaMemcpy3DBatchAsync
        f3d.restype = ctypes.c_int
        f3d.argtypes = ([ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p]
                        if v13 else [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_ulonglong, ctypes.c_void_p])  # fmt: skip
        assert ctypes.sizeof(Batch3DOp) == 112, ctypes.sizeof(Batch3DOp)
        ops = (Batch3DOp * s.n)()
        host_loc = _MemLocation(CUDA_MEM_LOCATION_TYPE_HOST, 0)
        dev_loc = _MemLocation(CUDA_MEM_LOCATION_TYPE_DEVICE, 0)
        for i in range(s.n):
            op = ops[i]
            op.src = Operand(1, s.dev_ptr + int(s.back_d[i]) * s.page_bytes, s.dev_ls, s.layers,
                             dev_loc)  # fmt: skip
            op.dst = Operand(1, s.host_ptr + int(s.back_h[i]) * s.page_bytes, s.host_ls,
                             s.layers, host_loc)  # fmt: skip
            op.width, op.height, op.depth = s.page_bytes, s.layers, 1
            op.srcAccessOrder, op.flags = 1, 0

        def call3d() -> list[int]:
            t = time.perf_counter_ns()
            if v13:
                code = f3d(s.n, ctypes.addressof(ops), 0, handle)
            else:
                fail = ctypes.c_size_t(0)
                code = f3d(s.n, ctypes.addressof(ops), ctypes.addressof(fail), 0, handle)
            dt = time.perf_counter_ns() - t
            check(code, "cudaMemcpy3DBatchAsync")
            return [dt]

        try:
            s.clear_backup()
            call3d()
            if s.verify_backup("3d batch d2h"):
                runs = [timed(stream, call3d) for _ in range(args.reps + 1)][1:]
                cpu = statistics.median(c[0] for _, c in runs) / 1e3
                gb = gbps(total, statistics.median(m for m, _ in runs))
                row(f"3d batch, {s.n} ops x {s.layers} layers, d2h", cpu, "µs all layers", gb,
                    pin_d2h)  # fmt: skip
        except RuntimeError as error:
            say(f"3d batch: {error}")
            FAILURES.append(f"3d batch: {error}")

    # ---------------------------------------------------------------- graphs
    if "graph" not in skip:
        for name, argt in (
            ("cudaStreamBeginCapture", [ctypes.c_void_p, ctypes.c_int]),
            ("cudaStreamEndCapture", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cudaGraphInstantiate", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]),
            ("cudaGraphUpload", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cudaGraphLaunch", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cudaGraphExecDestroy", [ctypes.c_void_p]),
            ("cudaGraphDestroy", [ctypes.c_void_p]),
        ):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = argt
        try:
            capture_ns, inst_ns = [], []
            execs = []
            for layer in range(s.layers):
                graph = ctypes.c_void_p()
                exe = ctypes.c_void_p()
                t = time.perf_counter_ns()
                check(lib.cudaStreamBeginCapture(handle, 1), "cudaStreamBeginCapture")
                try:
                    batch_call(dl, sl, zl, layer * row_stride, s.n, attr_h2d, handle)
                finally:
                    ended = lib.cudaStreamEndCapture(handle, ctypes.byref(graph))
                check(ended, "cudaStreamEndCapture")
                t1 = time.perf_counter_ns()
                check(lib.cudaGraphInstantiate(ctypes.byref(exe), graph, 0), "Instantiate")
                check(lib.cudaGraphUpload(exe, handle), "Upload")
                t2 = time.perf_counter_ns()
                capture_ns.append(t1 - t)
                inst_ns.append(t2 - t1)
                execs.append((graph, exe))

            def launch_graphs() -> list[int]:
                out = []
                for _graph, exe in execs:
                    t = time.perf_counter_ns()
                    check(lib.cudaGraphLaunch(exe, handle), "cudaGraphLaunch")
                    out.append(time.perf_counter_ns() - t)
                return out

            s.clear_load()
            launch_graphs()
            if s.verify_load("graph h2d"):
                row("graph: capture one layer's batch", statistics.median(capture_ns) / 1e3,
                    "µs per layer", None, pin_h2d)  # fmt: skip
                row("graph: instantiate + upload", statistics.median(inst_ns) / 1e3,
                    "µs per layer", None, pin_h2d)  # fmt: skip
                runs = [timed(stream, launch_graphs) for _ in range(args.reps + 1)][1:]
                cpu = statistics.median(ns for _, c in runs for ns in c) / 1e3
                gb = gbps(total, statistics.median(m for m, _ in runs))
                row("graph: launch one layer", cpu, "µs per call", gb, pin_h2d)
            torch.cuda.synchronize()
            for graph, exe in execs:
                lib.cudaGraphExecDestroy(exe)
                lib.cudaGraphDestroy(graph)
        except RuntimeError as error:
            lib.cudaGetLastError()  # a refused capture leaves its error for torch's next check
            say(f"graph: {error}")
            FAILURES.append(f"graph: {error}")

    # ---------------------------------------------------------------- issuer thread
    if "thread" not in skip:
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            wait = cuda.cuStreamWaitValue64_v2
            write = cuda.cuStreamWriteValue64_v2
            for fn in (wait, write):
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            flag = torch.zeros(1, dtype=torch.int64, device="cuda")
            flag_ptr = flag.data_ptr()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side_handle = side.cuda_stream
            events = [new_event() for _ in range(s.layers)]
            work: queue.Queue[tuple[int, int] | None] = queue.Queue()
            seq = [0]

            def issuer() -> None:
                while True:
                    item = work.get()
                    if item is None:
                        return
                    layer, value = item
                    side.wait_event(events[layer])
                    batch_call(dl, sl, zl, layer * row_stride, s.n, attr_h2d, side_handle)
                    check(write(side_handle, flag_ptr, value, 0), "cuStreamWriteValue64")

            thread = threading.Thread(target=issuer, daemon=True)
            thread.start()

            def threaded() -> list[int]:
                out = []
                for layer in range(s.layers):
                    t = time.perf_counter_ns()
                    seq[0] += 1
                    events[layer].record(stream)
                    check(wait(handle, flag_ptr, seq[0], 0), "cuStreamWaitValue64")
                    work.put((layer, seq[0]))
                    out.append(time.perf_counter_ns() - t)
                return out

            s.clear_load()
            with torch.cuda.stream(stream):
                threaded()
            stream.synchronize()
            if s.verify_load("issuer thread h2d"):
                runs = [timed(stream, threaded) for _ in range(args.reps + 1)][1:]
                cpu = statistics.median(ns for _, c in runs for ns in c) / 1e3
                gb = gbps(total, statistics.median(m for m, _ in runs))
                row("Python issuer thread: caller per layer", cpu, "µs per call", gb, pin_h2d)
            work.put(None)
            thread.join(10)
        except (RuntimeError, OSError, AttributeError) as error:
            say(f"issuer thread: {error}")
            FAILURES.append(f"issuer thread: {error}")

    table = "\n".join(
        [
            f"Command: `python benchmarks/copy_issue.py {' '.join(argv)}`  ",
            f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, cudart "
            f"{copier.runtime_version}, {os.cpu_count()} CPUs; {args.layers} layers x "
            f"{args.tokens} tokens, page {args.page_size}, rows of {args.row_bytes} B "
            f"({s.page_bytes:,} B page copies), random pages; medians of {args.reps} after one "
            f"warm-up; bytes verified first. Pinned 1 GiB, same run: H2D {pin_h2d:.1f} GB/s, "
            f"D2H {pin_d2h:.1f} GB/s.",
            "",
            "| method | CPU µs | per | GPU GB/s | of pinned |",
            "|---|---:|---|---:|---:|",
            *ROWS,
        ]
    )
    say("\n" + table)
    if args.append is not None:
        with args.append.open("a", encoding="utf-8") as out:
            out.write(f"\n## The copy engine's issue floor (benchmarks/copy_issue.py), "
                      f"{time.strftime('%Y-%m-%d')}\n\n{table}\n")  # fmt: skip
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
