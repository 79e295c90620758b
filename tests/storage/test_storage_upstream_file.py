"""Upstream SGLang's own ``HiCacheFile``, read from the 0.5.10 and 0.5.23 wheels, under our tier.

Real files in a temporary directory, written and read by upstream's code; the tier, the tree
and the bytes check are ours. The wheels are fetched at test time (``fetch_wheel_tree``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from storage_fakes import FakeHostPool, TreeSide, make_tier

from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.adapters.upstream_storage import UpstreamFileStorage
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.protocols import StorageHostPool

PAGE = 4
TOKENS = list(range(300, 316))


@pytest.fixture(params=["0.5.10", "0.5.23"])
def upstream_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    tree = fetch_wheel_tree(str(request.param))
    name = f"test-upstream-file-{request.param}"

    def build(
        config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        return UpstreamFileStorage(tree, tmp_path / "l3", config)

    StorageBackendFactory.register_backend(name, build)
    yield name
    StorageBackendFactory.unregister_backend(name)


def test_upstream_hicache_file_round_trips_through_our_tier(upstream_backend: str) -> None:
    pool = FakeHostPool(size=64, page_size=PAGE)
    tier = make_tier(pool)
    tier.attach_storage_backend(upstream_backend, prefetch_threshold=PAGE, model_name="m")
    tree = TreeSide(tier, pool)
    source = pool.alloc(16)
    assert source is not None
    pool.fill(source, seed=3)
    tier.write_storage(source, TOKENS)
    tree.settle()
    assert tree.backup_acks == [16]
    tree.start("r", TOKENS)
    tree.settle()
    assert torch.equal(pool.read(tree.inserted["r"]), pool.read(source))
    backend = tier.storage_backend
    assert isinstance(backend, UpstreamFileStorage)
    files = sorted(p.name for p in backend.root_dir.iterdir())
    assert len(files) == 4 and all(name.endswith("_m_0_1.bin") for name in files)
    tier.detach_storage_backend()
