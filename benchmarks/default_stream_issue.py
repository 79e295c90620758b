"""Why a load issued on the legacy default stream costs the runtime's batch call (issue 30).

``benchmarks/new_load_op.py`` saw later layers of a new load take ~300-500 us of CPU on the
default stream and ~10 us on a side stream. This times the same loads (one CUDA
``MLATokenToKVPool``, 576 bf16 rows, 32,768 random-page tokens, page 64, 61 layers, pinned
``layer_first`` host pool, ``copy_path="batch"``) three ways, each at gaps 0 and 10 ms before
an operation, three rounds alternated:

- ``default``: the default stream, as today (the issuing thread keyed on stream 0);
- ``default via proxy``: the same, with each layer rerouted through a non-default stream that
  waits for the default one and is waited for by it (``wait_stream`` both ways);
- ``side``: a ``torch.cuda.Stream`` (the controller's load stream).

For each: the later layers' CPU quantiles (25/50/75/95%, us) and the part of it spent inside
``CopyIssuer.issue`` (the native ``hc_issue``: the caller's two stream memory operations).

    python benchmarks/default_stream_issue.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hicache_ref.device import CudaDevice
from hicache_ref.pools import MLATokenToKVPool, copy_engine, copy_issuer, make_host_pool

TOKENS, PAGE, LAYERS = 32768, 64, 61
INSIDE: list[float] = []


def main() -> int:
    original_issue = copy_issuer.CopyIssuer.issue
    original_rows = copy_engine.CudaBatchCopier.issue_rows
    proxies: dict[int, torch.cuda.Stream] = {}

    def timed_issue(self: copy_issuer.CopyIssuer, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter_ns()
        original_issue(self, *args, **kwargs)
        INSIDE.append((time.perf_counter_ns() - start) / 1e3)

    def via_proxy(self: copy_engine.CudaBatchCopier, rows: Any, device: Any, *args: Any) -> None:
        if torch._C._cuda_getCurrentRawStream(rows.device_index) != 0:
            original_rows(self, rows, device, *args)
            return
        proxy = proxies.get(rows.device_index)
        if proxy is None:
            proxy = proxies[rows.device_index] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(device)
        proxy.wait_stream(current)
        with torch.cuda.stream(proxy):
            original_rows(self, rows, device, *args)
        current.wait_stream(proxy)

    copy_issuer.CopyIssuer.issue = timed_issue  # type: ignore[method-assign]
    device = CudaDevice()
    pages = TOKENS // PAGE
    size = 2 * pages * PAGE
    device_pool = MLATokenToKVPool(size, PAGE, torch.bfloat16, 512, 64, LAYERS, device)
    host_pool = make_host_pool(device_pool, layout="layer_first", size_tokens=size,
                               copy_path="batch")  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    host_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    device_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    offsets = torch.arange(PAGE)
    host_indices = (host_pages[:, None] * PAGE + offsets).reshape(-1)
    device_indices = (device_pages[:, None] * PAGE + offsets).reshape(-1)
    load = host_pool.load_to_device_per_layer
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def stream_context(stream: torch.cuda.Stream | None) -> Any:
        return torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream())

    for stream in (None, side):  # warm-up: both issuers started, the pair planned
        with stream_context(stream):
            for layer in range(LAYERS):
                load(device_pool, host_indices, device_indices, layer, "direct")
    torch.cuda.synchronize()

    def quantiles(values: list[float]) -> list[float]:
        values = sorted(values)
        return [round(values[int(q * (len(values) - 1))], 1) for q in (0.25, 0.5, 0.75, 0.95)]

    def operations(gap: float, stream: torch.cuda.Stream | None,
                   rows: Callable[..., None]) -> tuple[list[float], list[float]]:  # fmt: skip
        copy_engine.CudaBatchCopier.issue_rows = rows  # type: ignore[method-assign]
        later: list[float] = []
        inside: list[float] = []
        for _ in range(15):
            host, dev = host_indices.clone(), device_indices.clone()
            torch.cuda.synchronize()
            time.sleep(gap)
            with stream_context(stream):
                for layer in range(LAYERS):
                    INSIDE.clear()
                    start = time.perf_counter_ns()
                    load(device_pool, host, dev, layer, "direct")
                    if layer:
                        later.append((time.perf_counter_ns() - start) / 1e3)
                        inside.append(sum(INSIDE))
        torch.cuda.synchronize()
        copy_engine.CudaBatchCopier.issue_rows = original_rows  # type: ignore[method-assign]
        return quantiles(later), quantiles(inside)

    print(torch.cuda.get_device_name(0), torch.__version__, f"{torch.get_num_threads()} threads")
    ways = (("default", None, original_rows), ("default via proxy", None, via_proxy),
            ("side", side, original_rows))  # fmt: skip
    for round_ in range(3):
        for name, stream, rows in ways:
            for gap in (0.0, 0.01):
                later, inside = operations(gap, stream, rows)
                print(f"round {round_} | {name} | gap {gap * 1e3:.0f} ms | later layers us "
                      f"{later} | inside hc_issue us {inside}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
