"""Which steps of a trace make the host wait for the forward stream on a GPU, and where.

A stream-order bug is visible on a GPU only while the work it races is still queued: a missing
fence between the forward stream and the load stream shows when an H2D overtakes a queued
store. Anything that makes the host wait for the forward stream in between (a pageable upload
on it, a ``.tolist()`` of a tensor it produces) drains the queue and closes the window, on every
schedule. This replays a trace on CUDA and, before each step, queues a long spin on the world's
forward stream; a step whose host time reaches the spin waited for it, and a watchdog thread
records the main thread's stack while it waits (the innermost frames of this project).

    python benchmarks/host_waits.py fuzz/corpus/mutants/skip_load_fence.jsonl [--spin-ms 100]

Prints one line per step (rule, host ms, WAITED and the blocking frames); exit 0 either way.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.world import gpu_config, on_device, open_device

CYCLES_PER_MS = 1_980_000
"""An H200's SM clock, about 1.98 GHz: ``torch.cuda._sleep`` counts cycles."""


class Watchdog:
    """Samples the main thread's stack once a step has run longer than ``after_s``."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.main = threading.main_thread().ident
        self.started: float | None = None
        self.stack: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self.stack, self.started = [], time.perf_counter()

    def end(self) -> list[str]:
        self.started = None
        return self.stack

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            started = self.started
            if started is None or self.stack or time.perf_counter() - started < self.after_s:
                continue
            frame = sys._current_frames().get(self.main or 0)
            if frame is not None:
                frames = traceback.extract_stack(frame)
                ours = [f for f in frames if "hicache_ref" in f.filename]
                self.stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[-6:]]
                self.stack.append(f"(innermost: {Path(frames[-1].filename).name}:"
                                  f"{frames[-1].lineno} {frames[-1].name})")  # fmt: skip

    def stop(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--spin-ms", type=float, default=100.0)
    parser.add_argument("--implementation", default=None)
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"trace {args.trace} is not a file; pass a .jsonl trace (fuzz/corpus/...)")
    if args.spin_ms <= 0:
        parser.error(f"--spin-ms must be > 0, got {args.spin_ms}")
    if not torch.cuda.is_available():
        print("host_waits: needs a CUDA GPU")
        return 2
    trace = Trace.read(args.trace)
    name = args.implementation or trace.header.implementation
    config = gpu_config(trace.header.config)
    print(f"{args.trace}: {name}, {len(trace.steps)} steps, copy_path {config.copy_path}, "
          f"forward_stream {config.forward_stream}, spin {args.spin_ms} ms")  # fmt: skip
    watchdog = Watchdog(after_s=args.spin_ms / 2000)
    with open_device("cuda", trace.header.perturbation) as build:
        session = Session(
            config, on_device(get_implementation(name, ""), "cuda"), name, build=build
        )
        attach_lockstep(session)
        try:
            for index, step in enumerate(trace.steps):
                world = session.world
                torch.cuda.synchronize()
                with world.device.stream(world.forward_stream):
                    torch.cuda._sleep(int(args.spin_ms * CYCLES_PER_MS))
                watchdog.begin()
                started = time.perf_counter()
                try:
                    outcome = session.apply(step).text
                except Exception as exc:  # the trace may fail on a mutant: that is a result
                    outcome = f"raised {type(exc).__name__}: {str(exc)[:80]}"
                host_ms = (time.perf_counter() - started) * 1000
                stack = watchdog.end()
                waited = host_ms >= args.spin_ms / 2
                print(f"{index:3d} {step.rule:<16} {host_ms:8.1f} ms "
                      f"{'WAITED' if waited else '      '} {outcome[:60]}")  # fmt: skip
                for line in stack if waited else []:
                    print(f"      {line}")
                if outcome.startswith("raised"):
                    break
        finally:
            torch.cuda.synchronize()
            session.close()
            watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
