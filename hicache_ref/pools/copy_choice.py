"""Which copy path ``copy_path="auto"`` takes: the fastest legal one where the transfer runs.

On the CPU (``SimDevice``: device pool, host buffers and indices all on the CPU) ``auto`` is the
reference ``gather``; with CPU pools and a CUDA index tensor it is ``runs``, as before. Between
a host pool and a CUDA device pool it is, in this order (``choose_gpu_copy_path``):

1. ``batch``, the copy engine (``cudaMemcpyBatchAsync``, no SM used), when this process's CUDA
   runtime has it (12.8+), the layout keeps a layer's rows in runs (not ``page_first`` or
   ``page_head``: ``BATCH_REFUSED_LAYOUTS``) and every component's page copy is at least
   ``BATCH_PAGE_COPY_BYTES_MIN``: the engine is at the link for large copies and slow for small
   ones;
2. ``triton``, the zero-copy kernel, when Triton is importable and the host buffers are pinned
   (the kernel reads them from the GPU);
3. ``runs`` (one ``copy_`` per merged run) otherwise.

Measured on an H200 (32,768 tokens x 61 layers, random pages, ``benchmarks/transfer.py``):
``layer_first`` page 64 (64-74 KB copies): ``batch`` 98-99% of a pinned copy, ``triton``
91-92%, ``runs`` 2-5%; page 16 (16-18 KB copies): ``batch`` 7-9% H2D, ``triton`` 91-92%;
``page_first`` page 64 (no ``batch``): ``triton`` 76-92%, ``runs`` 2-3%. The crossover between
18 KB and 64 KB copies was not measured; 32 KiB splits the two measured sizes.

When ``auto`` takes ``triton`` on ``page_first``, it launches ``AUTO_TRITON_PROGRAMS_PER_COMPONENT``
programs per component (``auto_triton_programs``) instead of the default grid shared by all
components: a page_first layer's rows are scattered over the whole host span, and the kernel
needs more rows in flight per component to stay at the link. Measured on an H200 (page 64, the
2026-12-02 sweep in benchmarks/RESULTS.md): MLA 90%/87% of pinned (H2D/D2H) at 8 programs, 92%/92%
at 16; MHA (K and V in one launch) 78%/74% at 8 programs in all, 78%/77% at 16, 93%/90% at 32.
Beside a persistent matmul the larger grid slows it 1.04x (MLA, 16) and 1.12x (MHA, 32),
against 1.01-1.02x at the default grid: a transfer speed bought with SMs, on the one layout
the copy engine cannot take.

``probe_copy_runtime`` asks the process once what it has (``CopyRuntime``); tests hand
``choose_gpu_copy_path`` a runtime of their own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_ref.pools.host_layout import HostLayout

ConcreteCopyPath = Literal["gather", "runs", "batch", "triton"]

BATCH_PAGE_COPY_BYTES_MIN = 32 * 1024
"""Smallest page copy (one page of one component) ``auto`` hands the copy engine."""

BATCH_REFUSED_LAYOUTS: dict[HostLayout, str] = {
    "page_first": (
        "its slots interleave the layers, so a layer is one copy per token row (measured on an "
        "H200: 1-3% of a pinned copy, ~1.5 us of CPU per row)"
    ),
    "page_head": "its rows split into one head_dim piece per head, smaller still than a row",
}
"""Layouts ``batch`` refuses, and why: the copy engine pays per copy, and these layouts
fragment one layer into one copy per row (or per head)."""


AUTO_TRITON_PROGRAMS_PER_COMPONENT: dict[HostLayout, int] = {"page_first": 16}
"""Layouts whose ``auto`` Triton launch gets its own grid: programs per component (module doc)."""


def auto_triton_programs(layout: HostLayout) -> int | None:
    """Programs per component ``auto``'s Triton launches get on ``layout`` (``None``: the
    default grid, shared by a launch's components)."""
    return AUTO_TRITON_PROGRAMS_PER_COMPONENT.get(layout)


@dataclass(frozen=True)
class CopyRuntime:
    """What this process can execute besides ``runs``, and why not where it cannot."""

    batch: bool
    """``cudaMemcpyBatchAsync`` found in the CUDA runtime torch loaded (12.8+)."""
    triton: bool
    """``import triton`` can work."""
    batch_missing: str = ""
    """Why ``batch`` is unavailable (the loader's message), for reports."""


@functools.cache
def probe_copy_runtime() -> CopyRuntime:
    """This process's ``CopyRuntime`` (looked up once: loading the runtime costs milliseconds)."""
    from hicache_ref.pools.copy_engine import CopyEngineError, load_cuda_batch_copier
    from hicache_ref.pools.triton_copy import is_triton_available

    triton = is_triton_available()
    if not torch.cuda.is_available():
        return CopyRuntime(batch=False, triton=triton, batch_missing="no CUDA device")
    try:
        load_cuda_batch_copier()
    except CopyEngineError as error:
        return CopyRuntime(batch=False, triton=triton, batch_missing=str(error))
    return CopyRuntime(batch=True, triton=triton)


def compute_page_copy_bytes(
    row_shapes: Mapping[str, tuple[int, ...]], element_size: int, page_size: int
) -> dict[str, int]:
    """Bytes of one page of each component: the size of one copy when pages are scattered."""
    return {name: page_size * math.prod(shape) * element_size for name, shape in row_shapes.items()}


def choose_gpu_copy_path(
    *,
    layout: HostLayout,
    page_copy_bytes: Mapping[str, int],
    host_pinned: bool,
    runtime: CopyRuntime,
) -> ConcreteCopyPath:
    """``auto`` between a host pool and a CUDA device pool (the order in the module doc)."""
    smallest_copy = min(page_copy_bytes.values(), default=0)
    if (
        runtime.batch
        and layout not in BATCH_REFUSED_LAYOUTS
        and smallest_copy >= BATCH_PAGE_COPY_BYTES_MIN
    ):
        return "batch"
    if runtime.triton and host_pinned:
        return "triton"
    return "runs"


def choose_auto_copy_path(
    *,
    layout: HostLayout,
    page_copy_bytes: Mapping[str, int],
    device_type: str,
    host_pinned: bool,
    all_cpu: bool,
    runtime: CopyRuntime | None = None,
) -> ConcreteCopyPath:
    """What ``auto`` runs for one transfer: ``gather`` when every tensor is on the CPU, the GPU
    choice when the device pool is on CUDA, else ``runs``; ``runtime`` defaults to the probe."""
    if all_cpu:
        return "gather"
    if device_type != "cuda":
        return "runs"
    return choose_gpu_copy_path(
        layout=layout,
        page_copy_bytes=page_copy_bytes,
        host_pinned=host_pinned,
        runtime=probe_copy_runtime() if runtime is None else runtime,
    )


def describe_copy_runtime(runtime: CopyRuntime) -> str:
    """One line for reports: what ``auto`` can pick from in this process."""
    batch = (
        "batch (cudaMemcpyBatchAsync)" if runtime.batch else f"no batch ({runtime.batch_missing})"
    )
    triton = "triton" if runtime.triton else "no triton"
    return f"{batch}, {triton}, runs"
