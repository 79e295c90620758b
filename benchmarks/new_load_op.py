"""CPU cost of a controller's new load operation on the GPU: layer 0 (index checks, plan,
descriptor table) and each later layer's issue, per stream (issue 30).

One CUDA ``MLATokenToKVPool`` (576 bf16 rows, ``--tokens`` random-page tokens, page 64, 61
layers) and its pinned ``layer_first`` host pool on ``copy_path="batch"``. Each operation clones
the index tensors (a new pair, as each load batch of the controller is), synchronizes, sleeps
``gap`` seconds (the pool's threads may go idle between loads, as a scheduler's do), then loads
every layer with ``load_to_device_per_layer``, ``time.perf_counter_ns`` around each call. Prints
layer 0's median and the later layers' quantiles (0, 25, 50, 75, 95, 100%), on the default
stream at gaps 0 and 10 ms, and on a side stream (the controller's load stream) at 10 ms.

    python benchmarks/new_load_op.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hicache_ref.device import CudaDevice
from hicache_ref.pools import MLATokenToKVPool, make_host_pool

TOKENS, PAGE, LAYERS = 32768, 64, 61


def main() -> int:
    device = CudaDevice()
    pages = TOKENS // PAGE
    size = 2 * pages * PAGE
    device_pool = MLATokenToKVPool(size, PAGE, torch.bfloat16, 512, 64, LAYERS, device)
    host_pool = make_host_pool(
        device_pool, layout="layer_first", size_tokens=size, copy_path="batch"
    )
    generator = torch.Generator().manual_seed(1)
    host_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    device_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    offsets = torch.arange(PAGE)
    host_indices = (host_pages[:, None] * PAGE + offsets).reshape(-1)
    device_indices = (device_pages[:, None] * PAGE + offsets).reshape(-1)
    load = host_pool.load_to_device_per_layer
    for layer in range(LAYERS):  # warm-up
        load(device_pool, host_indices, device_indices, layer, "direct")
    torch.cuda.synchronize()

    def ops(count: int, gap: float) -> tuple[int, list[int]]:
        first: list[float] = []
        later: list[float] = []
        for _ in range(count):
            host, dev = host_indices.clone(), device_indices.clone()
            torch.cuda.synchronize()
            time.sleep(gap)
            for layer in range(LAYERS):
                start = time.perf_counter_ns()
                load(device_pool, host, dev, layer, "direct")
                (first if layer == 0 else later).append((time.perf_counter_ns() - start) / 1e3)
        later.sort()
        quantiles = [round(later[int(q * (len(later) - 1))]) for q in (0, 0.25, 0.5, 0.75, 0.95, 1)]
        return round(statistics.median(first)), quantiles

    print("intra-op threads", torch.get_num_threads())
    for gap in (0.0, 0.01):
        print(
            f"default stream, gap {gap}: layer 0 median µs, later layers quantiles µs", ops(30, gap)
        )
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        print("side stream, gap 0.01: layer 0 median µs, later layers quantiles µs", ops(30, 0.01))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
