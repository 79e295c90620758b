"""Index checks of a transfer (INV-01).

``check_transfer_layer`` checks the layer one per-layer transfer addresses;
``check_transfer_indices`` validates one index pair (lengths, signs, bounds, unique
destinations) and returns the values on the CPU; ``check_page_first_direct_chunks`` adds the
whole-page rule of the ``direct`` backend's page-local layouts. A CUDA index tensor is copied to
the CPU for these checks (``_host_values``), one host sync each.

The checks of a large pair run in numpy, not torch: torch splits a CPU op of 32,768 elements or
more over its intra-op threads, and waking them costs the caller milliseconds where the pool's
threads have gone to sleep between loads (issue 30; ``benchmarks/RESULTS.md``); numpy runs the
same math on the calling thread.
"""

from __future__ import annotations

import operator
from typing import Any, Literal

import numpy as np
import torch

from hicache_ref.errors import (
    HiCacheInputError,
    IndexOutsidePoolError,
    LayerOutsidePoolError,
    LayerRangeError,
    PageAlignmentError,
)
from hicache_ref.pools.page_index import (
    as_cpu_int64,
    check_index_tensor,
    get_small_cpu_values,
    validate_page_aligned_token_indices,
)

Direction = Literal["d2h", "h2d"]


def check_transfer_layer(device_pool: Any, layer_id: int) -> int:
    """The device pool's local ``layer_id`` of one per-layer transfer, or
    ``LayerOutsidePoolError`` (INV-06): a copy of a layer the pool does not have lands nowhere.
    An integer type other than ``int`` (``numpy.int64``, a 0-d tensor) comes back as ``int``, a
    float is refused (``TypeError``): launches are kept per ``int`` layer (``layer_launch``)."""
    layer_id = operator.index(layer_id)
    try:
        layer: int = device_pool.check_layer_id(layer_id)
    except LayerRangeError as exc:
        raise LayerOutsidePoolError(
            f"INV-06: a transfer addressed {exc}; a per-layer copy may name only its own "
            "pool's layers (map the layer with that pool's layer mapper)"
        ) from None
    return layer


def _host_values(indices: torch.Tensor) -> torch.Tensor:
    """Index values on the CPU as int64 (a CUDA tensor costs one sync; see the module doc)."""
    return as_cpu_int64(indices)


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
    host_list, device_list = get_small_cpu_values(host), get_small_cpu_values(device)
    for name, values, listed, bound in (
        ("host_indices", host, host_list, host_size),
        ("device_indices", device, device_list, device_rows),
    ):
        if values.numel() == 0:
            continue
        if listed:
            low, high = min(listed), max(listed)
        else:
            array = values.numpy()
            low, high = int(array.min()), int(array.max())
        # Verify no negative index (sgl-kernel would skip it and leave the row stale)
        if low < 0:
            position = int((values < 0).nonzero()[0, 0])
            raise HiCacheInputError(
                f"{name}[{position}]={int(values[position])} is negative; sgl-kernel silently "
                "skips negative indices, so they are refused here"
            )
        # Verify every index addresses a row of its pool
        if high >= bound:
            position = int((values >= bound).nonzero()[0, 0])
            raise IndexOutsidePoolError(
                f"INV-05: {name}[{position}]={int(values[position])} is outside its pool's rows "
                f"[0, {bound}); a transfer may address only rows and slots its own pool hands out"
            )
    destination, listed, name = (
        (host, host_list, "host_indices")
        if direction == "d2h"
        else (device, device_list, "device_indices")
    )
    # Verify no destination row is written twice
    if _repeats_a_value(destination, listed):
        raise HiCacheInputError(
            f"{name} (the {direction} destination) repeats a row; each destination row may be "
            "written once per transfer"
        )
    return host, device


def _repeats_a_value(values: torch.Tensor, listed: list[int] | None) -> bool:
    """Whether a CPU int64 index tensor holds a value twice (``listed``: its values, if small)."""
    if listed is not None:
        return len(set(listed)) != len(listed)
    ordered = np.sort(values.numpy(), kind="stable")
    return bool((ordered[1:] == ordered[:-1]).any())


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
    chunk = _first_broken_chunk(device, chunks, page_size)
    if chunk is not None:
        start = int(chunks[chunk, 0])
        raise PageAlignmentError(
            f"INV-01: device_indices chunk {chunk} holds {chunks[chunk].tolist()}; with "
            "page_first_direct or layer_page_first each page chunk must be contiguous, e.g. "
            f"[{start}..{start + page_size - 1}]"
        )


def _first_broken_chunk(device: torch.Tensor, chunks: torch.Tensor, page_size: int) -> int | None:
    """The first device chunk that is not ``page_size`` consecutive locs (Python when small)."""
    values = get_small_cpu_values(device)
    if values is not None:
        for chunk, base in enumerate(range(0, len(values), page_size)):
            start = values[base]
            if values[base : base + page_size] != list(range(start, start + page_size)):
                return chunk
        return None
    expected = chunks[:, :1] + torch.arange(page_size, dtype=torch.int64)
    bad = (chunks != expected).any(dim=1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
