"""An independent side pool's window in L3: stored with its node, read all-or-nothing (INV-39).

The tier gets a side pool of host slots of its own (``add_window_pool``: the SWA or Mamba pool
a controller attaches); the tree names the window on each call (``extra_pools``). The
stories: a node's SWA window round-trips beside its KV pages, each page under ``<key>.swa``;
a hit served shorter than the staged window reads the served hit's trailing pages and gives
the staged tail back; a hit is the longest prefix whose window is stored, not the KV run; a
Mamba state is stored once per node, under its last page key, so only the node's end is
restorable; a window is not read when a KV page of the hit did not land; a call naming a window
the tier does not store is refused with the fix; ranks agree on the longest prefix every rank
restores, not the MIN of each rank's longest (F28); and an MLA rank that skips the replicated
KV still stores its rank-sharded Mamba state.
"""

from __future__ import annotations

import pytest
import torch
from storage_fakes import FakeHostPool, MLATokenToKVPool, make_tier

from hicache_ref.controller.storage import (
    RankGroup,
    StorageStepKind,
    StorageTier,
    run_lockstep,
    run_until_idle,
)
from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation
from hicache_ref.storage.pool_transfers import (
    MAMBA_POOL,
    SWA_POOL,
    TRAILING_PAGES,
    PoolTransfer,
    component_key,
)

PAGE = 4
TOKENS = list(range(300, 316))  # four pages
PLACEHOLDER = "__placeholder__"


def make(pool: str = SWA_POOL) -> tuple[StorageTier, FakeHostPool, FakeHostPool]:
    kv = FakeHostPool(size=64, page_size=PAGE)
    side = FakeHostPool(size=64, page_size=1 if pool == MAMBA_POOL else PAGE, layer_num=1)
    tier = make_tier(kv)
    tier.add_window_pool(pool, side)
    tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
    return tier, kv, side


def back_up(
    tier: StorageTier, kv: FakeHostPool, side: FakeHostPool, pool: str = SWA_POOL
) -> torch.Tensor:
    """Store the node ``TOKENS`` with its window: every page's SWA page, or its one state."""
    side_host = write_node(tier, kv, side, pool)
    tier.run_until_idle()
    assert tier.queues.ack_backup_queue.get_nowait().completed_tokens == len(TOKENS)
    return side_host


def write_node(
    tier: StorageTier, kv: FakeHostPool, side: FakeHostPool, pool: str = SWA_POOL
) -> torch.Tensor:
    """``write_storage`` of the node ``TOKENS`` naming its window; its side host slots."""
    host = kv.alloc(len(TOKENS))
    assert host is not None
    kv.fill(host, seed=1)
    keys = tier.compute_page_keys(TOKENS, None)
    side_host = side.alloc(1 if pool == MAMBA_POOL else len(TOKENS))
    assert side_host is not None
    side.fill(side_host, seed=7)
    window_keys = keys[-1:] if pool == MAMBA_POOL else keys
    window = PoolTransfer(pool, side_host, window_keys, hit_policy=TRAILING_PAGES)
    tier.write_storage(host, TOKENS, extra_pools=[window])
    return side_host


def query(
    tier: StorageTier, tokens: list[int], window_pages: int, pool: str = SWA_POOL
) -> tuple[PrefetchOperation, PoolTransfer]:
    """``prefetch`` naming a window of placeholder keys; the agreed hit comes back."""
    window = PoolTransfer(pool, keys=[PLACEHOLDER] * window_pages, hit_policy=TRAILING_PAGES)
    operation = tier.prefetch("r1", tokens, extra_pools=[window])
    tier.run_step(StorageStepKind.HIT_QUERY)
    assert tier.queues.prefetch_hit_queue.get_nowait() is operation
    return operation, window


def serve(
    tier: StorageTier,
    kv: FakeHostPool,
    side: FakeHostPool,
    operation: PrefetchOperation,
    window: PoolTransfer,
    served_pages: int,
) -> list[PrefetchAck]:
    """The tree stages the window at the hit (before any cut), serves ``served_pages`` of the
    hit, and runs the IO and the sync to the end; the published acks."""
    hit_pages = operation.storage_hit_count // PAGE
    staged = side.alloc(min(len(window.keys or ()), hit_pages) * side.page_size)
    assert staged is not None
    window.host_indices = staged
    operation.hash_value = operation.hash_value[:served_pages]  # a host-pressure cut
    operation.storage_hit_count = served_pages * PAGE
    operation.host_indices = kv.alloc(served_pages * PAGE)
    tier.queues.prefetch_buffer.put(operation)
    tier.run_until_idle()
    queue = tier.queues.ack_prefetch_queue
    return [queue.get_nowait() for _ in range(queue.qsize())]


def pool_hits(acks: list[PrefetchAck]) -> dict[str, int]:
    (hits,) = [dict(ack.pool_hits) for ack in acks if ack.pool_hits is not None]
    return hits


def stored(tier: StorageTier, key: str) -> bool:
    backend = tier.storage_backend
    assert backend is not None
    return bool(backend.exists(key))


def test_a_nodes_swa_window_round_trips_beside_its_kv_pages() -> None:
    tier, kv, side = make()
    source = back_up(tier, kv, side)
    keys = tier.compute_page_keys(TOKENS, None)
    assert all(stored(tier, component_key(key, SWA_POOL)) for key in keys)  # <key>.swa
    # prefetch with a two-page window -> the whole hit, its last two SWA pages read after the KV
    operation, window = query(tier, TOKENS, window_pages=2)
    assert operation.storage_hit_count == len(TOKENS)
    acks = serve(tier, kv, side, operation, window, served_pages=4)
    assert pool_hits(acks) == {SWA_POOL: 2, MAMBA_POOL: 0}
    assert window.keys == keys[2:]
    assert window.host_indices is not None
    assert torch.equal(side.read(window.host_indices), side.read(source[2 * PAGE :]))


def test_a_hit_served_cut_reads_the_served_hits_window_and_gives_the_tail_back() -> None:
    tier, kv, side = make()
    source = back_up(tier, kv, side)
    keys = tier.compute_page_keys(TOKENS, None)
    operation, window = query(tier, TOKENS, window_pages=3)
    # staged for the 4-page hit (3 pages), served cut to 2 -> the window is pages 0 and 1
    acks = serve(tier, kv, side, operation, window, served_pages=2)
    assert window.keys == keys[:2]
    assert window.host_indices is not None and window.host_indices.numel() == 2 * PAGE
    released = tier.extra_host_mem_release_queues[SWA_POOL]
    assert released.qsize() == 1  # the staged third page, back to the side pool's tree
    assert pool_hits(acks) == {SWA_POOL: 2, MAMBA_POOL: 0}
    assert torch.equal(side.read(window.host_indices), side.read(source[: 2 * PAGE]))


def test_a_hit_is_the_longest_prefix_whose_window_is_stored() -> None:
    tier, kv, side = make()
    back_up(tier, kv, side)
    backend = tier.storage_backend
    assert isinstance(backend, MemoryStorage)
    last = tier.compute_page_keys(TOKENS, None)[3]
    with backend.store.lock:  # L3 loses the last page's SWA page (an eviction)
        del backend.store.pages[backend._storage_key(component_key(last, SWA_POOL))]
    operation, _ = query(tier, TOKENS, window_pages=1)
    assert operation.restorable_prefix_pages == [1, 2, 3]
    assert operation.storage_hit_count == 3 * PAGE  # not the KV run of 4 pages


def test_a_mamba_state_is_stored_once_under_its_nodes_last_page_key() -> None:
    tier, kv, side = make(MAMBA_POOL)
    source = back_up(tier, kv, side, MAMBA_POOL)
    keys = tier.compute_page_keys(TOKENS, None)
    assert [stored(tier, component_key(key, MAMBA_POOL)) for key in keys] == [0, 0, 0, 1]
    # three pages of the node: no state ends there -> no hit
    short, _ = query(tier, TOKENS[: 3 * PAGE], window_pages=1, pool=MAMBA_POOL)
    assert short.storage_hit_count == 0
    tier.terminate_prefetch(short)
    # the whole node: its state comes back with its KV pages
    operation, window = query(tier, TOKENS, window_pages=1, pool=MAMBA_POOL)
    acks = serve(tier, kv, side, operation, window, served_pages=4)
    assert pool_hits(acks) == {SWA_POOL: 0, MAMBA_POOL: 1}
    assert window.host_indices is not None
    assert torch.equal(side.read(window.host_indices), side.read(source))


def test_a_window_is_not_read_when_a_kv_page_of_the_hit_did_not_land() -> None:
    tier, kv, side = make()
    back_up(tier, kv, side)
    operation, window = query(tier, TOKENS, window_pages=2)
    backend = tier.storage_backend
    assert isinstance(backend, MemoryStorage)
    key = tier.compute_page_keys(TOKENS, None)[1]
    with backend.store.lock:  # gone between the query and the read
        del backend.store.pages[backend._storage_key(key)]
    acks = serve(tier, kv, side, operation, window, served_pages=4)
    assert pool_hits(acks) == {SWA_POOL: 0, MAMBA_POOL: 0}  # the tree discards it whole
    assert window.keys == [PLACEHOLDER] * 2  # never re-aligned, never read
    assert tier.extra_host_mem_release_queues[SWA_POOL].qsize() == 0


def test_a_window_the_tier_does_not_store_is_refused_with_the_fix() -> None:
    tier, kv, _ = make()
    host = kv.alloc(len(TOKENS))
    assert host is not None
    keys = tier.compute_page_keys(TOKENS, None)
    mamba = PoolTransfer(MAMBA_POOL, torch.arange(1), keys[-1:], hit_policy=TRAILING_PAGES)
    with pytest.raises(HiCacheInputError, match="not a window this tier stores"):
        tier.write_storage(host, TOKENS, extra_pools=[mamba])
    short = PoolTransfer(SWA_POOL, torch.arange(PAGE), keys[-2:], hit_policy=TRAILING_PAGES)
    with pytest.raises(HiCacheInputError, match="one page of the pool per key"):
        tier.write_storage(host, TOKENS, extra_pools=[short])
    staged = PoolTransfer(SWA_POOL, torch.arange(PAGE), [PLACEHOLDER], hit_policy=TRAILING_PAGES)
    with pytest.raises(HiCacheInputError, match="the tree stages them at the hit"):
        tier.prefetch("r1", TOKENS, extra_pools=[staged])


def test_ranks_agree_on_the_longest_prefix_every_rank_restores_not_the_min_of_their_longest() -> (
    None
):
    # rank 0 lost page 4's SWA page, rank 1 page 3's: with a one-page window rank 0 restores
    # 1, 2, 3 pages and rank 1 1, 2, 4; the MIN of the longest (3) is a prefix rank 1 cannot
    # restore (F28), the agreed hit is 2 pages on both ranks
    group = RankGroup(2, timeout_s=2.0)
    ranks = []
    for rank in range(2):
        kv = FakeHostPool(size=64, page_size=PAGE)
        side = FakeHostPool(size=64, page_size=PAGE, layer_num=1)
        tier = make_tier(kv, collectives=group.view(rank))
        tier.add_window_pool(SWA_POOL, side)
        tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
        ranks.append((tier, kv, side))
    for tier, kv, side in ranks:
        write_node(tier, kv, side)
    run_until_idle([tier for tier, _, _ in ranks], group)
    keys = ranks[0][0].compute_page_keys(TOKENS, None)
    for (tier, _, _), lost in zip(ranks, (keys[3], keys[2]), strict=True):
        backend = tier.storage_backend
        assert isinstance(backend, MemoryStorage)
        with backend.store.lock:
            del backend.store.pages[backend._storage_key(component_key(lost, SWA_POOL))]
    window = [PoolTransfer(SWA_POOL, keys=[PLACEHOLDER], hit_policy=TRAILING_PAGES)]
    operations = [tier.prefetch("r1", TOKENS, extra_pools=window) for tier, _, _ in ranks]
    run_lockstep([tier for tier, _, _ in ranks], group, StorageStepKind.HIT_QUERY)
    assert [op.restorable_prefix_pages for op in operations] == [[1, 2, 3], [1, 2, 4]]
    assert [op.storage_hit_count for op in operations] == [2 * PAGE, 2 * PAGE]


def test_an_mla_rank_that_skips_the_kv_still_stores_its_mamba_state() -> None:
    # an MLA rank other than 0 holds rank 0's KV but its own (rank-sharded) Mamba state: its
    # backup stores no KV page, stores the state under the node's last page key and acks the
    # span once the state is stored (upstream's should_backup keeps MAMBA on every rank)
    group = RankGroup(2, timeout_s=2.0)
    kv = FakeHostPool(size=64, page_size=PAGE)
    side = FakeHostPool(size=64, page_size=1, layer_num=1)
    tier = make_tier(kv, collectives=group.view(1), device_pool=MLATokenToKVPool(16))
    tier.add_window_pool(MAMBA_POOL, side)
    tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
    assert tier.backup_skip
    write_node(tier, kv, side, MAMBA_POOL)
    tier.run_step(StorageStepKind.BACKUP)
    assert tier.queues.ack_backup_queue.get_nowait().completed_tokens == len(TOKENS)
    keys = tier.compute_page_keys(TOKENS, None)
    assert not any(stored(tier, key) for key in keys)  # no KV page: rank 0's
    assert stored(tier, component_key(keys[-1], MAMBA_POOL))
