"""A draft sidecar in L3: its pages stored, found and read with the KV's, or not counted (INV-37).

The tier gets a second host pool indexed by the KV's slots (``add_sidecar_pool``: the draft
pool a controller attaches). The stories: a page round-trips with its draft bytes; a hit stops
at the first page whose draft page is gone; a draft read that fails after the hit cuts the
progress there; a backup whose draft write fails stores no KV page either; and the v2 calls
refuse, with one line naming the fix, a pool never registered, a hit policy they do not store
and slots that do not match the keys.
"""

from __future__ import annotations

import pytest
import torch
from storage_fakes import FakeHostPool, TreeSide, make_tier

from hicache_ref.controller.storage import StorageTier
from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.pool_transfers import (
    DRAFT_POOL,
    PoolTransfer,
    component_key,
    count_pool_hits,
    restorable_prefixes,
)

PAGE = 4
TOKENS = list(range(200, 216))  # four pages


def make() -> tuple[StorageTier, FakeHostPool, FakeHostPool, TreeSide]:
    pool = FakeHostPool(size=64, page_size=PAGE)
    draft = FakeHostPool(size=64, page_size=PAGE, layer_num=1)
    tier = make_tier(pool)
    tier.add_sidecar_pool(DRAFT_POOL, draft)
    tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
    return tier, pool, draft, TreeSide(tier, pool)


def back_up(tier: StorageTier, pool: FakeHostPool, draft: FakeHostPool) -> torch.Tensor:
    host = pool.alloc(len(TOKENS))
    assert host is not None
    pool.fill(host, seed=1)
    draft.fill(host, seed=7)  # the draft layers at the KV's slots
    tier.write_storage(host, TOKENS)
    tier.run_until_idle()
    assert tier.queues.ack_backup_queue.get_nowait().completed_tokens == len(TOKENS)
    return host


def drop_draft_page(tier: StorageTier, page: int) -> None:
    """L3 loses the draft page of the ``page``-th page of ``TOKENS`` (an eviction)."""
    backend = tier.storage_backend
    assert isinstance(backend, MemoryStorage)
    key = tier.compute_page_keys(TOKENS, None)[page]
    with backend.store.lock:
        del backend.store.pages[backend._storage_key(component_key(key, DRAFT_POOL))]


def test_a_page_round_trips_with_its_draft_bytes() -> None:
    tier, pool, draft, tree = make()
    source = back_up(tier, pool, draft)
    tree.start("r1", TOKENS)
    tree.settle()
    landed = tree.inserted["r1"]
    assert landed.numel() == len(TOKENS)
    assert torch.equal(pool.read(landed), pool.read(source))
    assert torch.equal(draft.read(landed), draft.read(source))


def test_a_hit_stops_at_the_first_page_whose_draft_page_is_gone() -> None:
    tier, pool, draft, tree = make()
    back_up(tier, pool, draft)
    drop_draft_page(tier, 1)
    operation = tree.start("r1", TOKENS)
    tree.settle()
    assert operation.storage_hit_count == PAGE  # page 0 only: page 1's KV alone is no hit
    assert tree.inserted["r1"].numel() == PAGE


def test_a_page_whose_sidecar_read_fails_is_not_counted() -> None:
    tier, pool, draft, tree = make()
    source = back_up(tier, pool, draft)
    tier.storage_batch_size = 4
    operation = tree.start("r1", TOKENS)
    tier.run_step(tier.hit_query.kind)
    tree.drain_hits()
    assert operation.storage_hit_count == len(TOKENS)
    drop_draft_page(tier, 2)  # gone between the query and the read
    tree.settle()
    landed = tree.inserted["r1"]
    assert landed.numel() == 2 * PAGE  # pages 0 and 1: the KV read of pages 2 and 3 is not enough
    assert torch.equal(draft.read(landed), draft.read(source[: 2 * PAGE]))


def test_a_backup_whose_draft_write_fails_stores_no_kv_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, pool, _, _ = make()
    backend = tier.storage_backend
    assert backend is not None
    refused = {DRAFT_POOL: [False] * len(TOKENS)}
    monkeypatch.setattr(backend, "batch_set_v2", lambda transfers, extra_info=None: refused)
    host = pool.alloc(len(TOKENS))
    assert host is not None
    tier.write_storage(host, TOKENS)
    tier.run_until_idle()
    assert tier.queues.ack_backup_queue.get_nowait().completed_tokens == 0
    assert backend.batch_exists(tier.compute_page_keys(TOKENS, None)) == 0


def test_v2_calls_name_the_fix_for_a_pool_a_policy_or_slots_they_cannot_take() -> None:
    backend = MemoryStorage()
    pool = FakeHostPool(size=16, page_size=PAGE, layer_num=1)
    slots = torch.arange(PAGE)
    with pytest.raises(HiCacheInputError, match="register_mem_host_pool_v2"):
        backend.batch_get_v2([PoolTransfer(DRAFT_POOL, slots, ["k"])])
    backend.register_mem_host_pool_v2(pool, DRAFT_POOL)
    with pytest.raises(HiCacheInputError, match="one page of slots per key"):
        backend.batch_set_v2([PoolTransfer(DRAFT_POOL, slots, ["k", "l"])])
    backend.batch_set(["k"], [torch.zeros(8)])
    groups = PoolTransfer(DRAFT_POOL, keys=["k"], hit_policy="block_groups")
    with pytest.raises(HiCacheInputError, match="trailing_pages"):
        backend.batch_exists_v2(["k"], [groups])


def test_a_trailing_pool_makes_only_prefixes_whose_window_is_stored_restorable() -> None:
    # KV pages a b c d stored; the SWA pages of b and d only -> a window of 1 page restores
    # the prefixes ending at b or d, a window of 2 none (HiCacheFile's trailing_pages rule)
    backend = MemoryStorage()
    page = torch.zeros(8)
    backend.batch_set(["a", "b", "c", "d"], [page] * 4)
    backend.batch_set(["b.swa", "d.swa"], [page] * 2)
    one = PoolTransfer("swa", keys=["__placeholder__"], hit_policy="trailing_pages")
    result = backend.batch_exists_v2(["a", "b", "c", "d"], [one])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [2, 4])
    assert result.extra_pool_hit_pages == {"swa": 4}
    two = PoolTransfer("swa", keys=["__placeholder__"] * 2, hit_policy="trailing_pages")
    assert backend.batch_exists_v2(["a", "b", "c", "d"], [two]).kv_hit_pages == 0
    assert restorable_prefixes([False, True, True], 2) == [3]


def test_a_sidecar_read_counts_its_leading_run_only() -> None:
    assert count_pool_hits({"draft": [True, False, True]}) == {"draft": 1}
    assert count_pool_hits({"draft": []}) == {"draft": 0}
