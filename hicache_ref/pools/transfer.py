"""Host <-> device KV copies: checked and planned at launch, bytes moved when the stream runs.

Semantics (both io backends, every layout): for each selected layer and every component,
``dst[dst_indices[i]] = src[src_indices[i]]``; d2h reads the device pool and writes the host pool,
h2d the reverse. Upstream's kernels skip negative indices silently and the ``*_direct_pf`` paths
misplace non-contiguous pages silently; here both are refused at launch (INV-01). The ``direct``
backend moves ``page_first_direct`` and ``layer_page_first`` page by page, so those transfers
take whole host pages and contiguous device chunks (``check_page_first_direct_chunks``).

A ``page_head`` or ``page_first`` run view is strided (heads or layers interleave), so a ``runs``
copy between it and a GPU goes through a contiguous temporary inside ``copy_``: correct bytes,
one staging copy per run.

Four ways to execute the same semantics, chosen per launch by ``copy_path``:

- ``gather``: vectorised advanced indexing. Only when every tensor involved is on the CPU (the
  simulator). The closure reads the index tensors when it runs, like a kernel reading device
  indices, so a caller that mutates indices before the stream runs sees the effect.
- ``runs``: the ``transfer_kv_direct`` way. The index pairs are merged at launch into maximal
  runs (``page_math.plan_copy_runs``; split at host pages for the ``PAGE_LOCAL_LAYOUTS``:
  ``page_first_direct``, ``page_head``, ``layer_page_first``), and the
  closure issues one ``copy_(..., non_blocking=True)`` per run, layer and component. This is the
  path for a real GPU: slice copies between pinned host memory and device memory are ordered on
  the current stream. Planning needs the index values on the host, so a CUDA index tensor is
  copied to the CPU here: the one host sync in the transfer path, unavoidable in pure torch
  (upstream's direct backend does the same ``.cpu()``).
- ``batch``: the copy engine at the PCIe ceiling. The pairs are validated once, merged into
  runs of rows contiguous on both sides and turned into byte offsets per component
  (``copy_plan``), one plan per transfer (``fast_transfer``), and into every layer's addresses
  at once (``DescriptorTable``); each layer then hands its row to one ``cudaMemcpyBatchAsync``
  (``copy_engine``), issued by a native thread behind two stream operations on the current
  stream (``copy_issuer``), or, on the CPU, one ``memmove`` per copy when the stream runs. ``page_first`` and
  ``page_head`` are refused (``BATCH_REFUSED_LAYOUTS``): their layers are one copy per token
  row (or head), and the copy engine pays per copy; use ``triton`` (or ``runs``) there.
  Measured on an H200 (32,768 tokens x 61 layers, random pages, ``benchmarks/transfer.py``):
  page 64 (64-74 KB copies) reaches 98% of a pinned copy per direction with no SM used (a
  matmul beside it slows by ~1-2%), and 66-101% of both pinned directions with load and backup
  at once; the caller's CPU was 13-28 us per layer (2026-12-04, ~5-10 us of it the pool API's
  Python, which ``layer_launch`` cuts to ~0.4-2 us on the 2-core dev machine: RESULTS.md
  2026-12-06, the runner not measured again) and 0.1-0.5 ms per all-layer backup through the
  issuing thread (0.3-1.1 ms and 15-64 ms when the runtime's ~0.46 us per copy is paid on
  the caller's thread, ``HICACHE_COPY_ISSUE=inline``); page 16 (16-18
  KB copies) falls to 7% for H2D (the copy engine reads small host copies slowly) and 34-69%
  for D2H.
- ``triton``: a zero-copy Triton kernel reading or writing the pinned host pool directly
  (``triton_copy``), index tensors on the device, every layout; on the CPU it runs under
  Triton's interpreter. Measured: ~91% of pinned per direction with a 132-program grid at page
  16 and 64, 32-37% (H2D) with 32 programs; it competes with compute for SMs.

``auto`` picks ``gather`` when everything is on the CPU; between a host pool and a CUDA device
pool the copy engine's ``batch`` where the layout and the copy size suit it and the runtime has
it, else ``triton`` where Triton is installed and the host pool pinned, else ``runs``
(``copy_choice``, with the measurements behind the order).

``prepare_transfer`` does every check and all the planning of one transfer and returns a
``PreparedTransfer``, whose ``closure(layer_ids)`` and ``meta(layer_ids)`` are a launch of those
layers with nothing checked again; ``launch_transfer`` prepares and launches in one call. The
host pool keeps the prepared transfer of each index pair its per-layer loads and backups use
(``layer_launch``), so a batch's later layers are a lookup. ``batch`` and ``triton`` also keep
their plans in ``PLAN_CACHE`` (keyed by the index tensors' identity and in-place version); a CUDA
index tensor is copied to the CPU once per plan, for the checks and the pointer arithmetic
(``transfer_checks``: one host sync each). With CPU index tensors nothing on the
``batch`` issue path synchronizes the host. Like ``runs`` (and unlike ``gather``), ``batch``
reads the index values at launch; ``triton`` reads its device-side indices when the kernel runs
(a CPU index tensor is copied to the device at launch, through pinned memory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_ref.device.protocol import DeviceModule
from hicache_ref.errors import HiCacheInputError, UnknownOptionError
from hicache_ref.pools import copy_choice
from hicache_ref.pools.copy_choice import (
    BATCH_REFUSED_LAYOUTS,
    CopyRuntime,
    auto_triton_programs,
    choose_auto_copy_path,
    compute_page_copy_bytes,
)
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.fast_transfer import PLAN_CACHE, Stepped, prepare_fast_transfer
from hicache_ref.pools.host_layout import (
    PAGE_LOCAL_LAYOUTS,
    HostLayout,
    IoBackend,
    host_row_index,
    host_run_view,
    is_whole_page_transfer,
)
from hicache_ref.pools.page_math import plan_copy_runs, split_runs_at_pages
from hicache_ref.pools.transfer_checks import (
    Direction,
    check_page_first_direct_chunks,
    check_transfer_indices,
)
from hicache_ref.pools.triton_copy import TRITON_LAUNCH_DEFAULT, TritonLaunch

__all__ = [
    "COPY_PATHS",
    "PLAN_CACHE",
    "CopyPath",
    "Direction",
    "PreparedTransfer",
    "check_copy_path",
    "check_copy_path_for_layout",
    "check_page_first_direct_chunks",
    "check_transfer_indices",
    "copy_paths_for_layout",
    "launch_transfer",
    "plan_runs",
    "prepare_transfer",
    "resolve_copy_path",
]

CopyPath = Literal["auto", "gather", "runs", "batch", "triton"]
COPY_PATHS: tuple[CopyPath, ...] = ("auto", "gather", "runs", "batch", "triton")

Run = tuple[int, int, int]


@functools.cache
def copy_paths_for_layout(layout: HostLayout) -> tuple[CopyPath, ...]:
    """The copy paths that can drive ``layout`` (asked on every launch: computed once)."""
    return tuple(
        path for path in COPY_PATHS if path != "batch" or layout not in BATCH_REFUSED_LAYOUTS
    )


def check_copy_path_for_layout(copy_path: CopyPath, layout: HostLayout) -> None:
    """Refuse ``batch`` for the layouts whose layers are not contiguous runs of rows."""
    # Verify the copy path can move this layout's layers as a few large copies
    if copy_path not in copy_paths_for_layout(layout):
        raise HiCacheInputError(
            f"copy_path={copy_path!r} cannot drive host layout {layout!r}: "
            f"{BATCH_REFUSED_LAYOUTS[layout]}; legal copy paths for it: "
            f"{', '.join(copy_paths_for_layout(layout))}"
        )


def check_copy_path(copy_path: str) -> CopyPath:
    """Return ``copy_path`` typed, or raise ``UnknownOptionError`` naming the legal values."""
    if copy_path not in COPY_PATHS:
        raise UnknownOptionError(
            f"unknown copy_path {copy_path!r}; legal values: {', '.join(COPY_PATHS)}"
        )
    return copy_path


def plan_runs(
    host: torch.Tensor,
    device: torch.Tensor,
    *,
    direction: Direction,
    layout: HostLayout,
    page_size: int,
) -> list[Run]:
    """Maximal ``(src_start, dst_start, length)`` runs; none crosses a host page for the
    ``PAGE_LOCAL_LAYOUTS``."""
    host_list = [int(v) for v in host.tolist()]
    device_list = [int(v) for v in device.tolist()]
    if direction == "d2h":
        runs = plan_copy_runs(device_list, host_list)
    else:
        runs = plan_copy_runs(host_list, device_list)
    if layout in PAGE_LOCAL_LAYOUTS:
        runs = split_runs_at_pages(runs, page_size, split_src=direction == "h2d")
    return runs


def _gather_closure(
    *,
    direction: Direction,
    layout: HostLayout,
    page_size: int,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    layer_ids: Sequence[int],
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
) -> Callable[[], None]:
    pairs = [
        (layer_id, host_buffers[name], device_pool.component_buffer(name, layer_id))
        for layer_id in layer_ids
        for name in device_pool.component_names()
    ]

    def run() -> None:
        # The index tensors are read now, when the stream runs (like a kernel's device indices).
        host = host_indices.to(torch.int64)
        device = device_indices.to(torch.int64)
        for layer_id, host_buffer, device_buffer in pairs:
            key = host_row_index(layout, layer_id, host, page_size)
            if direction == "d2h":
                host_buffer[key] = device_buffer[device]
            else:
                device_buffer[device] = host_buffer[key]

    return run


def _runs_closure(
    *,
    direction: Direction,
    layout: HostLayout,
    page_size: int,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    layer_ids: Sequence[int],
    runs: list[Run],
) -> Callable[[], None]:
    pairs = [
        (layer_id, host_buffers[name], device_pool.component_buffer(name, layer_id))
        for layer_id in layer_ids
        for name in device_pool.component_names()
    ]

    def run() -> None:
        for layer_id, host_buffer, device_buffer in pairs:
            for src_start, dst_start, length in runs:
                if direction == "d2h":
                    host_view = host_run_view(
                        layout, host_buffer, layer_id, dst_start, length, page_size
                    )
                    host_view.copy_(
                        device_buffer[src_start : src_start + length], non_blocking=True
                    )
                else:
                    host_view = host_run_view(
                        layout, host_buffer, layer_id, src_start, length, page_size
                    )
                    device_buffer[dst_start : dst_start + length].copy_(
                        host_view, non_blocking=True
                    )

    return run


def resolve_copy_path(
    copy_path: CopyPath,
    *,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    layout: HostLayout,
    page_size: int,
    all_cpu: bool,
    host_pinned: bool | None = None,
) -> CopyPath:
    """The path a launch takes: ``copy_path`` itself, or what ``auto`` picks here
    (``copy_choice``); ``host_pinned`` (default: asked of the buffers) matters on CUDA only."""
    if copy_path != "auto":
        return copy_path
    on_gpu = device_pool.device.type == "cuda"
    if on_gpu and host_pinned is None:
        host_pinned = all(buffer.is_pinned() for buffer in host_buffers.values())
    # the probe itself is cached; asked here so a test's replacement of it is seen
    runtime = copy_choice.probe_copy_runtime() if on_gpu and not all_cpu else None
    return _auto_choice(
        layout,
        page_size,
        tuple(device_pool.component_row_shapes().items()),
        device_pool.dtype.itemsize,
        device_pool.device.type,
        bool(host_pinned),
        all_cpu,
        runtime,
    )


@functools.lru_cache(maxsize=256)
def _auto_choice(
    layout: HostLayout,
    page_size: int,
    row_shapes: tuple[tuple[str, tuple[int, ...]], ...],
    itemsize: int,
    device_type: str,
    host_pinned: bool,
    all_cpu: bool,
    runtime: CopyRuntime | None,
) -> CopyPath:
    """``choose_auto_copy_path`` for one geometry and runtime (a pure function of them, so
    asked once: every launch resolves ``auto``)."""
    return choose_auto_copy_path(
        layout=layout,
        page_copy_bytes=compute_page_copy_bytes(dict(row_shapes), itemsize, page_size),
        device_type=device_type,
        host_pinned=host_pinned,
        all_cpu=all_cpu,
        runtime=runtime,
    )


def _all_on_cpu(
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
) -> bool:
    if device_pool.device.type != "cpu" or not (host_indices.is_cpu and device_indices.is_cpu):
        return False
    for buffer in host_buffers.values():  # a plain loop: this runs on every launch
        if not buffer.is_cpu:
            return False
    return True


@dataclass(frozen=True)
class PreparedTransfer:
    """One transfer checked and planned (``prepare_transfer``): ``closure(layer_ids)`` is the
    stream work of those layers and ``meta(layer_ids)`` what observers are told of it; neither
    checks anything again, so reuse one only while its index tensors are unchanged."""

    direction: Direction
    io_backend: IoBackend
    components: tuple[str, ...]
    host: torch.Tensor
    """The validated host indices (CPU int64)."""
    device: torch.Tensor
    """The validated device indices (CPU int64)."""
    closure: Callable[[Sequence[int]], Callable[[], None]]
    stepped: Stepped | None = None
    """``batch`` on CUDA only: ``stepped(layer_ids, after_layer)`` is ``closure([layer])``
    then ``after_layer(layer)`` for each of the consecutive ``layer_ids``, with the copy
    engine running the layers back to back (``fast_transfer.BatchLayers.stepped``)."""

    def meta(self, layer_ids: tuple[int, ...]) -> dict[str, object]:
        """The launch's ``meta`` (``DeviceModule.launch``) for ``layer_ids``."""
        return {
            "direction": self.direction,
            "layer_ids": layer_ids,
            "host_indices": self.host,
            "device_indices": self.device,
            "io_backend": self.io_backend,
            "components": self.components,
        }


def prepare_transfer(
    *,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    layout: HostLayout,
    page_size: int,
    host_size: int,
    direction: Direction,
    io_backend: IoBackend,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    copy_path: CopyPath,
    host_pinned: bool | None = None,
    triton: TritonLaunch = TRITON_LAUNCH_DEFAULT,
) -> PreparedTransfer:
    """Check and plan one transfer for any of the pools' layers (the bytes move when a launch of
    its ``closure`` runs).

    ``auto`` is resolved first (``resolve_copy_path``; ``host_pinned`` spares asking the
    buffers); ``triton`` is the kernel path's launch shape."""
    all_cpu = _all_on_cpu(device_pool, host_buffers, host_indices, device_indices)
    requested = copy_path
    copy_path = resolve_copy_path(
        copy_path,
        device_pool=device_pool,
        host_buffers=host_buffers,
        layout=layout,
        page_size=page_size,
        all_cpu=all_cpu,
        host_pinned=host_pinned,
    )
    components = device_pool.component_names()
    if copy_path == "batch" or copy_path == "triton":
        check_copy_path_for_layout(copy_path, layout)
        per_component = None
        if requested == "auto" and copy_path == "triton":
            per_component = auto_triton_programs(layout)
        fast = prepare_fast_transfer(
            device_pool=device_pool,
            host_buffers=host_buffers,
            layout=layout,
            page_size=page_size,
            host_size=host_size,
            direction=direction,
            io_backend=io_backend,
            host_indices=host_indices,
            device_indices=device_indices,
            copy_path=copy_path,
            programs_per_component=per_component,
            triton=triton,
        )
        return PreparedTransfer(
            direction,
            io_backend,
            components,
            fast.plan.host,
            fast.plan.device,
            fast.closure,
            fast.stepped,
        )
    host, device = check_transfer_indices(
        host_indices,
        device_indices,
        direction=direction,
        host_size=host_size,
        device_rows=device_pool.size + device_pool.page_size,
    )
    if is_whole_page_transfer(io_backend, layout):
        check_page_first_direct_chunks(host, device, page_size)
    if copy_path == "gather" and not all_cpu:
        raise HiCacheInputError(
            "copy_path='gather' needs host buffers, device buffers and indices on the CPU; "
            "use 'runs' (or 'auto') with a GPU"
        )
    if copy_path == "runs":
        runs = plan_runs(host, device, direction=direction, layout=layout, page_size=page_size)

        def runs_closure(layer_ids: Sequence[int]) -> Callable[[], None]:
            return _runs_closure(
                direction=direction,
                layout=layout,
                page_size=page_size,
                host_buffers=host_buffers,
                device_pool=device_pool,
                layer_ids=layer_ids,
                runs=runs,
            )

        return PreparedTransfer(direction, io_backend, components, host, device, runs_closure)

    def gather_closure(layer_ids: Sequence[int]) -> Callable[[], None]:
        return _gather_closure(
            direction=direction,
            layout=layout,
            page_size=page_size,
            host_buffers=host_buffers,
            device_pool=device_pool,
            layer_ids=layer_ids,
            host_indices=host_indices,
            device_indices=device_indices,
        )

    return PreparedTransfer(direction, io_backend, components, host, device, gather_closure)


def launch_transfer(
    *,
    device_module: DeviceModule,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    layout: HostLayout,
    page_size: int,
    host_size: int,
    direction: Direction,
    io_backend: IoBackend,
    layer_ids: Sequence[int],
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    copy_path: CopyPath,
    label: str,
    host_pinned: bool | None = None,
    triton: TritonLaunch = TRITON_LAUNCH_DEFAULT,
) -> None:
    """Check, plan and launch one transfer of ``layer_ids`` on the current stream
    (``prepare_transfer``, then one launch)."""
    prepared = prepare_transfer(
        device_pool=device_pool,
        host_buffers=host_buffers,
        layout=layout,
        page_size=page_size,
        host_size=host_size,
        direction=direction,
        io_backend=io_backend,
        host_indices=host_indices,
        device_indices=device_indices,
        copy_path=copy_path,
        host_pinned=host_pinned,
        triton=triton,
    )
    layers = tuple(layer_ids)
    device_module.launch(
        prepared.closure(layers), label=label, kind="copy", meta=prepared.meta(layers)
    )
