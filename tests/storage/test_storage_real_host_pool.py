"""Storage over the real host pools: a page backed up under one layout prefetches under another.

Every component is covered, the NSA indexer sidecar included (sglang#17085), and the two
controllers share only the file backend's directory (bug class 21).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from storage_fakes import TreeSide

from hicache_ref.controller.storage import StorageTier
from hicache_ref.device import SimDevice
from hicache_ref.pools import (
    HostKVCache,
    KVCache,
    MHATokenToKVPool,
    NSATokenToKVPool,
    make_host_pool,
)
from hicache_ref.storage.hashing import compute_page_hashes

PAGE = 4
TOKENS = list(range(500, 516))


def make_device_pool(kind: str) -> KVCache:
    if kind == "mha":
        return MHATokenToKVPool(32, PAGE, torch.float32, 2, 3, 2, SimDevice())
    return NSATokenToKVPool(32, PAGE, torch.float32, 3, 2, 2, SimDevice(), index_head_dim=4)


def attached_tier(kind: str, layout: str, root_dir: Path) -> tuple[StorageTier, HostKVCache]:
    device_pool = make_device_pool(kind)
    host_pool = make_host_pool(device_pool, layout=layout, size_tokens=64)
    tier = StorageTier(host_pool, device_pool, PAGE, executor="manual")
    tier.attach_storage_backend(
        "file", prefetch_threshold=PAGE, storage_backend_extra_config={"root_dir": str(root_dir)}
    )
    return tier, host_pool


def fill(host_pool: HostKVCache, slots: torch.Tensor) -> None:
    for c, (name, row_shape) in enumerate(host_pool.row_shapes.items()):
        for layer in range(host_pool.layer_num):
            numel = slots.numel() * int(torch.Size(row_shape).numel())
            values = torch.arange(numel, dtype=torch.float32) + 10_000 * c + 1_000 * layer
            host_pool.write_rows(name, layer, slots, values.reshape(slots.numel(), *row_shape))


def read_all(host_pool: HostKVCache, slots: torch.Tensor) -> list[torch.Tensor]:
    return [
        host_pool.read_rows(name, layer, slots)
        for name in host_pool.row_shapes
        for layer in range(host_pool.layer_num)
    ]


@pytest.mark.parametrize("kind", ["mha", "nsa"])
@pytest.mark.parametrize(
    ("write_layout", "read_layout"),
    [("layer_first", "page_first"), ("page_first", "page_first_direct")],
)
def test_backup_under_one_layout_prefetches_under_another(
    tmp_path: Path, kind: str, write_layout: str, read_layout: str
) -> None:
    writer, writer_pool = attached_tier(kind, write_layout, tmp_path)
    source = writer_pool.alloc(16)
    assert source is not None
    fill(writer_pool, source)
    writer.write_storage(source, TOKENS, hash_value=compute_page_hashes(TOKENS, PAGE))
    writer.run_until_idle()
    assert writer.queues.ack_backup_queue.get_nowait().completed_tokens == 16

    reader, reader_pool = attached_tier(kind, read_layout, tmp_path)
    tree = TreeSide(reader, reader_pool)  # type: ignore[arg-type]
    tree.start("r", TOKENS)
    tree.settle()
    bounce = tree.inserted["r"]
    assert bounce.numel() == 16
    for got, want in zip(read_all(reader_pool, bounce), read_all(writer_pool, source), strict=True):
        assert torch.equal(got, want)
    writer.detach_storage_backend()
    reader.detach_storage_backend()
