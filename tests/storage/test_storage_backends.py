"""Backends: round trips, misses, leading-run exists, first writer wins, keys and formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from storage_fakes import FakeHostPool

from hicache_ref.errors import HiCacheInputError
from hicache_ref.ids import HostSlot
from hicache_ref.storage.backend import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    compute_storage_key,
)
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.memory_backend import MemoryStorage, MemoryStore


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> HiCacheStorage:
    if request.param == "memory":
        return MemoryStorage()
    return FileStorage(tmp_path / "pages")


def page(value: float, numel: int = 8) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + value


def test_set_then_get_returns_the_same_bytes(backend: HiCacheStorage) -> None:
    assert backend.set("k1", page(1.0))
    target = torch.zeros(8)
    got = backend.get("k1", target)
    assert got is target and torch.equal(target, page(1.0))


def test_missing_key_reads_as_none(backend: HiCacheStorage) -> None:
    assert backend.get("absent", torch.zeros(8)) is None
    assert backend.batch_get(["absent"], [torch.zeros(8)]) == [None]
    assert not backend.exists("absent")


def test_batch_exists_counts_the_leading_run_of_hits(backend: HiCacheStorage) -> None:
    assert backend.batch_set(["a", "b", "d"], [page(0), page(1), page(3)])
    # a hit after the first miss does not count: a chain stops at its first missing page
    assert backend.batch_exists(["a", "b", "c", "d"]) == 2
    assert backend.batch_exists(["c", "a"]) == 0
    assert backend.batch_exists([]) == 0


def test_first_writer_wins(backend: HiCacheStorage) -> None:
    assert backend.set("k", page(1.0))
    assert backend.set("k", page(2.0))
    target = torch.zeros(8)
    backend.get("k", target)
    assert torch.equal(target, page(1.0))


def test_batch_get_fills_each_target_in_order(backend: HiCacheStorage) -> None:
    backend.batch_set(["a", "b"], [page(10), page(20)])
    got = backend.batch_get(["a", "x", "b"], [torch.zeros(8), torch.zeros(8), torch.zeros(8)])
    assert got[1] is None
    assert got[0] is not None and torch.equal(got[0], page(10))
    assert got[2] is not None and torch.equal(got[2], page(20))


def test_clear_drops_every_page(backend: HiCacheStorage) -> None:
    backend.batch_set(["a", "b"], [page(0), page(1)])
    backend.clear()
    assert backend.batch_exists(["a", "b"]) == 0


def shared_pair(kind: str, root: Path) -> tuple[HiCacheStorage, HiCacheStorage]:
    """Two ranks' clients of one L3: a shared memory store or one shared directory."""
    rank0, rank1 = (HiCacheStorageConfig(tp_rank=r, tp_size=2) for r in (0, 1))
    if kind == "memory":
        store = MemoryStore()
        return MemoryStorage(rank0, store), MemoryStorage(rank1, store)
    return FileStorage(root, rank0), FileStorage(root, rank1)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_clear_removes_only_its_own_namespace(kind: str, tmp_path: Path) -> None:
    # sglang#32693: clear() wiped a shared directory of every rank (INV-28)
    mine, theirs = shared_pair(kind, tmp_path)
    mine.set("a", page(0))
    theirs.set("a", page(1))
    mine.clear()
    assert not mine.exists("a") and theirs.exists("a")
    assert torch.equal(theirs.get("a", torch.zeros(8)), page(1))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_ranks_sharing_one_store_never_share_a_stored_key(kind: str, tmp_path: Path) -> None:
    # sglang#10969: keys without the rank, so ranks overwrote each other (INV-28)
    rank0, rank1 = shared_pair(kind, tmp_path)
    rank0.set("k", page(0))
    rank1.set("k", page(1))
    assert torch.equal(rank0.get("k", torch.zeros(8)), page(0))  # type: ignore[arg-type]
    assert torch.equal(rank1.get("k", torch.zeros(8)), page(1))  # type: ignore[arg-type]


def test_batch_set_needs_one_value_per_key(backend: HiCacheStorage) -> None:
    with pytest.raises(HiCacheInputError, match="pass one flat page per key"):
        backend.batch_set(["a", "b"], [page(0)])


def test_get_without_target_or_pool_names_the_fix(backend: HiCacheStorage) -> None:
    backend.set("k", page(0))
    if isinstance(backend, MemoryStorage):
        got = backend.get("k")
        assert got is not None and torch.equal(got, page(0))
    else:
        with pytest.raises(HiCacheInputError, match="register_mem_pool_host"):
            backend.get("k")


def test_memory_store_does_not_alias_the_written_tensor() -> None:
    store = MemoryStorage()
    source = page(1.0)
    store.set("k", source)
    source.fill_(-1)  # the host slot is reused and overwritten
    got = store.get("k")
    assert got is not None and torch.equal(got, page(1.0))
    got.fill_(-2)  # a reader scribbles on what it got
    again = store.get("k")
    assert again is not None and torch.equal(again, page(1.0))


def test_file_write_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    store.batch_set(["a", "b"], [page(0), page(1)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and all(n.endswith(".bin") for n in names)


def test_file_short_read_raises_from_get_and_reads_none_from_batch_get(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    store.set("k", page(0))
    (page_file,) = tmp_path.iterdir()
    page_file.write_bytes(page_file.read_bytes()[:-4])  # a torn page
    with pytest.raises(OSError, match="expected 32"):
        store.get("k", torch.zeros(8))
    assert store.batch_get(["k"], [torch.zeros(8)]) == [None]


def test_file_longer_than_the_page_is_a_format_mismatch(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    store.set("k", page(0, numel=16))
    with pytest.raises(OSError, match="more than"):
        store.get("k", torch.zeros(8))


def test_file_pages_survive_a_new_backend_on_the_same_directory(tmp_path: Path) -> None:
    FileStorage(tmp_path).set("k", page(5))
    target = torch.zeros(8)
    assert FileStorage(tmp_path).get("k", target) is not None
    assert torch.equal(target, page(5))


def test_extra_info_default_carries_no_prefix() -> None:
    # SGLang 0.5.10 defaulted prefix_keys to (None,), which is truthy (bug class 20)
    info = HiCacheStorageExtraInfo()
    assert info.prefix_keys is None
    assert not info.prefix_keys


def test_storage_key_has_rank_split_except_for_mla_and_pp_only_when_used() -> None:
    tp = HiCacheStorageConfig(tp_rank=1, tp_size=2, model_name="org/model")
    assert compute_storage_key("abc", tp, "fmt") == "abc_org-model_tp1of2_fmt"
    mla = HiCacheStorageConfig(tp_rank=1, tp_size=2, is_mla_model=True, pp_rank=0, pp_size=2)
    assert compute_storage_key("abc", mla, "fmt") == "abc_model_pp0of2_fmt"


def test_a_page_written_under_one_layout_reads_back_under_another(tmp_path: Path) -> None:
    # bug class 21: keys carry the flat format, not the layout, and the flat format is canonical
    writer_pool = FakeHostPool(size=8, page_size=4, layout="layer_first")
    reader_pool = FakeHostPool(size=8, page_size=4, layout="page_first")
    slots = torch.arange(4)
    writer_pool.fill(slots, seed=3)
    writer = FileStorage(tmp_path)
    writer.register_mem_pool_host(writer_pool)
    writer.set("k", writer_pool.get_data_page(HostSlot(0)))
    reader = FileStorage(tmp_path)
    reader.register_mem_pool_host(reader_pool)
    assert reader.format_tag == writer.format_tag
    data = reader.get("k")
    assert data is not None
    reader_pool.set_from_flat_data_page(HostSlot(4), data)
    assert torch.equal(reader_pool.read(torch.arange(4, 8)), writer_pool.read(slots))


def test_a_pool_with_another_page_geometry_misses_instead_of_reading_garbage(
    tmp_path: Path,
) -> None:
    writer = FileStorage(tmp_path)
    writer.register_mem_pool_host(FakeHostPool(size=8, page_size=4, head_dim=4))
    writer.set("k", page(0, numel=2 * 2 * 4 * 2 * 4))
    reader = FileStorage(tmp_path)
    reader.register_mem_pool_host(FakeHostPool(size=8, page_size=4, head_dim=8))
    assert not reader.exists("k")


def test_a_key_stored_before_the_pool_registers_is_not_found_under_the_pools_format(
    backend: HiCacheStorage,
) -> None:
    # the backend remembers storage keys, but only under the format tag they were made with
    assert backend.set("k", page(1.0))
    assert backend.exists("k")
    backend.register_mem_pool_host(FakeHostPool(size=8, page_size=4))
    assert backend._storage_key("k") == compute_storage_key("k", backend.config, backend.format_tag)
    assert not backend.exists("k")  # stored under the default format, asked under the pool's
    assert backend.set("k", page(2.0))
    assert backend.exists("k")
