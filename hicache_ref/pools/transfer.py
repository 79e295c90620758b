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

Two ways to execute the same semantics, chosen per launch by ``copy_path``:

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

``auto`` picks ``gather`` when everything is on the CPU and ``runs`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from hicache_ref.device.protocol import DeviceModule
from hicache_ref.errors import HiCacheInputError, PageAlignmentError, UnknownOptionError
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.host_layout import (
    PAGE_LOCAL_LAYOUTS,
    HostLayout,
    IoBackend,
    host_row_index,
    host_run_view,
    is_whole_page_transfer,
)
from hicache_ref.pools.page_index import check_index_tensor, validate_page_aligned_token_indices
from hicache_ref.pools.page_math import plan_copy_runs, split_runs_at_pages

Direction = Literal["d2h", "h2d"]
CopyPath = Literal["auto", "gather", "runs"]
COPY_PATHS: tuple[CopyPath, ...] = ("auto", "gather", "runs")

Run = tuple[int, int, int]


def check_copy_path(copy_path: str) -> CopyPath:
    """Return ``copy_path`` typed, or raise ``UnknownOptionError`` naming the legal values."""
    if copy_path not in COPY_PATHS:
        raise UnknownOptionError(
            f"unknown copy_path {copy_path!r}; legal values: {', '.join(COPY_PATHS)}"
        )
    return copy_path


def _host_values(indices: torch.Tensor) -> torch.Tensor:
    """Index values on the CPU as int64 (a CUDA tensor costs one sync; see the module doc)."""
    return indices.to(device="cpu", dtype=torch.int64)


def check_transfer_indices(
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    *,
    direction: Direction,
    host_size: int,
    device_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a transfer's index pair and return their CPU int64 values.

    Equal lengths, no negative index (sgl-kernel skips them silently; we refuse), every index
    inside its pool, and no destination written twice (the result would depend on copy order).
    """
    check_index_tensor(host_indices, "host_indices")
    check_index_tensor(device_indices, "device_indices")
    # Verify one device loc per host slot
    if host_indices.numel() != device_indices.numel():
        raise HiCacheInputError(
            f"host_indices has {host_indices.numel()} entries but device_indices has "
            f"{device_indices.numel()}; a transfer copies pairs, so the lengths must match"
        )
    host = _host_values(host_indices)
    device = _host_values(device_indices)
    for name, values, bound in (
        ("host_indices", host, host_size),
        ("device_indices", device, device_rows),
    ):
        if values.numel() == 0:
            continue
        # Verify no negative index (sgl-kernel would skip it and leave the row stale)
        if int(values.min()) < 0:
            position = int((values < 0).nonzero()[0, 0])
            raise HiCacheInputError(
                f"{name}[{position}]={int(values[position])} is negative; sgl-kernel silently "
                "skips negative indices, so they are refused here"
            )
        # Verify every index addresses a row of its pool
        if int(values.max()) >= bound:
            position = int((values >= bound).nonzero()[0, 0])
            raise HiCacheInputError(
                f"{name}[{position}]={int(values[position])} is outside its pool's rows [0, {bound})"
            )
    destination, name = (host, "host_indices") if direction == "d2h" else (device, "device_indices")
    # Verify no destination row is written twice
    if torch.unique(destination).numel() != destination.numel():
        raise HiCacheInputError(
            f"{name} (the {direction} destination) repeats a row; each destination row may be "
            "written once per transfer"
        )
    return host, device


def check_page_first_direct_chunks(
    host: torch.Tensor, device: torch.Tensor, page_size: int
) -> None:
    """``page_first_direct`` and ``layer_page_first`` under ``direct`` move whole pages: each host
    chunk one aligned page, each device chunk contiguous (upstream reads only the first index of
    each chunk) (INV-01)."""
    validate_page_aligned_token_indices(host, page_size, "host_indices")
    if device.numel() == 0:
        return
    chunks = device.view(-1, page_size)
    expected = chunks[:, :1] + torch.arange(page_size, dtype=torch.int64)
    bad = (chunks != expected).any(dim=1)
    if bool(bad.any()):
        chunk = int(bad.nonzero()[0, 0])
        start = int(chunks[chunk, 0])
        raise PageAlignmentError(
            f"INV-01: device_indices chunk {chunk} holds {chunks[chunk].tolist()}; with "
            "page_first_direct or layer_page_first each page chunk must be contiguous, e.g. "
            f"[{start}..{start + page_size - 1}]"
        )


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
) -> None:
    """Check, plan and launch one transfer on the current stream (the bytes move when it runs)."""
    host, device = check_transfer_indices(
        host_indices,
        device_indices,
        direction=direction,
        host_size=host_size,
        device_rows=device_pool.size + device_pool.page_size,
    )
    if is_whole_page_transfer(io_backend, layout):
        check_page_first_direct_chunks(host, device, page_size)
    tensors = [*host_buffers.values(), host_indices, device_indices]
    tensors += [device_pool.component_buffer(name, 0) for name in device_pool.component_names()]
    all_cpu = all(t.device.type == "cpu" for t in tensors)
    if copy_path == "gather" and not all_cpu:
        raise HiCacheInputError(
            "copy_path='gather' needs host buffers, device buffers and indices on the CPU; "
            "use 'runs' (or 'auto') with a GPU"
        )
    if copy_path == "runs" or (copy_path == "auto" and not all_cpu):
        runs = plan_runs(host, device, direction=direction, layout=layout, page_size=page_size)
        fn = _runs_closure(
            direction=direction,
            layout=layout,
            page_size=page_size,
            host_buffers=host_buffers,
            device_pool=device_pool,
            layer_ids=layer_ids,
            runs=runs,
        )
    else:
        fn = _gather_closure(
            direction=direction,
            layout=layout,
            page_size=page_size,
            host_buffers=host_buffers,
            device_pool=device_pool,
            layer_ids=layer_ids,
            host_indices=host_indices,
            device_indices=device_indices,
        )
    meta: dict[str, object] = {
        "direction": direction,
        "layer_ids": tuple(layer_ids),
        "host_indices": host,
        "device_indices": device,
        "io_backend": io_backend,
        "components": device_pool.component_names(),
    }
    device_module.launch(fn, label=label, kind="copy", meta=meta)
