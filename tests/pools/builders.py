"""Small pools and distinctive bytes for the pool tests.

Every row written by ``fill_rows`` holds values that encode (component, layer, loc, seed), so a
misplaced row is visible as a wrong number, and ``SENTINEL`` marks rows no transfer may touch.
"""

from __future__ import annotations

import torch

from hicache_ref.device import DeviceModule
from hicache_ref.pools import (
    HostKVCache,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
    make_host_pool,
)

POOL_KINDS = ("mha", "mla", "nsa")
SENTINEL = -7.0
ALL_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "layer_page_first")
MHA_ONLY_LAYOUTS = ("page_head",)  # upstream 0.5.10 has page_head for MHA host pools only


def layouts_for_kind(kind: str) -> tuple[str, ...]:
    """The host layouts a pool of ``kind`` can take (``page_head`` only for MHA)."""
    return tuple(
        layout for layout in ALL_LAYOUTS if kind == "mha" or layout not in MHA_ONLY_LAYOUTS
    )


def make_device_pool(
    kind: str,
    device_module: DeviceModule,
    *,
    size: int = 32,
    page_size: int = 4,
    layer_num: int = 3,
    start_layer: int = 0,
) -> KVCache:
    """A tiny device pool of ``kind`` (mha / mla / nsa) on ``device_module``."""
    if kind == "mha":
        return MHATokenToKVPool(
            size, page_size, torch.float32, 2, 3, layer_num, device_module, start_layer
        )
    if kind == "mla":
        return MLATokenToKVPool(
            size, page_size, torch.float32, 3, 2, layer_num, device_module, start_layer
        )
    return NSATokenToKVPool(
        size,
        page_size,
        torch.float32,
        3,
        2,
        layer_num,
        device_module,
        index_head_dim=4,
        start_layer=start_layer,
    )


def make_pools(
    kind: str,
    device_module: DeviceModule,
    *,
    page_size: int = 4,
    layout: str = "layer_first",
    copy_path: str = "auto",
    device_size: int = 32,
    host_size: int = 64,
    layer_num: int = 3,
) -> tuple[KVCache, HostKVCache]:
    """A device pool and its host pool."""
    device_pool = make_device_pool(
        kind, device_module, size=device_size, page_size=page_size, layer_num=layer_num
    )
    host_pool = make_host_pool(
        device_pool, layout=layout, size_tokens=host_size, copy_path=copy_path
    )
    return device_pool, host_pool


def row_values(
    pool: KVCache, component: str, layer_id: int, locs: torch.Tensor, seed: int
) -> torch.Tensor:
    """Distinctive rows: each element encodes (seed, component, layer, loc, element)."""
    row_shape = pool.component_row_shapes()[component]
    row_numel = 1
    for dim in row_shape:
        row_numel *= dim
    component_id = pool.component_names().index(component)
    base = seed * 1_000_000 + component_id * 100_000 + layer_id * 10_000
    element = torch.arange(row_numel, dtype=torch.float32) / 100
    rows = base + locs.to(torch.float32)[:, None] * 10 + element[None, :]
    return rows.reshape(len(locs), *row_shape)


def fill_device_rows(pool: KVCache, locs: torch.Tensor, seed: int) -> None:
    """Write distinctive rows at ``locs`` in every layer and component (synchronously)."""
    for component in pool.component_names():
        for layer_id in range(pool.layer_num):
            pool.write_rows(
                component, layer_id, locs, row_values(pool, component, layer_id, locs, seed)
            )


def fill_with_sentinel(device_pool: KVCache, host_pool: HostKVCache) -> None:
    """Every row of both pools becomes ``SENTINEL``."""
    for component in device_pool.component_names():
        for layer_id in range(device_pool.layer_num):
            device_pool.component_buffer(component, layer_id).fill_(SENTINEL)
        host_pool.buffers[component].fill_(SENTINEL)


def pages_to_locs(pages: list[int], page_size: int) -> torch.Tensor:
    """Token locs of ``pages`` in the given order."""
    return torch.tensor(
        [page * page_size + offset for page in pages for offset in range(page_size)],
        dtype=torch.int64,
    )
