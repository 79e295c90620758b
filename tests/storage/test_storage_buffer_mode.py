"""The tier's buffer mode and the tree's existence beliefs, one rule at a time (INV-41).

Stories: a host memory mode SGLang does not name is refused, naming the legal ones; buffer
mode rate-limits loads alone, so a pool full of write staging admits a hit and a pool full of
loads does not; the KV pool's verdict rides the hit's MIN, and a rank without an answer makes
it none; a belief follows the storage ack, in-flight refs count launched writes, a verdict
forgets past it and teaches up to it, and the LRU bound forgets the oldest.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hicache_ref.controller.storage.buffer_mode import (
    agree_pool_verdict,
    check_host_memory_mode,
    compute_load_capacity_limit,
    is_load_rate_limited,
)
from hicache_ref.controller.storage.collectives import ReduceOp, SyncGroup
from hicache_ref.controller.storage.existence_beliefs import StorageExistenceBeliefs
from hicache_ref.errors import HiCacheInputError


@dataclass
class Pool:
    size: int
    free: int

    def available_size(self) -> int:
        return self.free


@dataclass
class OtherRank:
    """A two-rank MIN whose other rank contributed ``values``."""

    values: tuple[int, ...]
    rank: int = 0
    world_size: int = 2

    def all_reduce(
        self, tensor: torch.Tensor, op: object = ReduceOp.SUM, group: SyncGroup | None = None
    ) -> None:
        assert op is ReduceOp.MIN
        mine = tensor.reshape(-1).tolist()
        reduced = [min(a, b) for a, b in zip(mine, self.values, strict=True)]
        tensor.copy_(torch.tensor(reduced, dtype=tensor.dtype))


def test_a_host_memory_mode_sglang_does_not_name_is_refused() -> None:
    with pytest.raises(HiCacheInputError, match=r"host_memory_mode='staging'.*\('cache', 'buffer"):
        check_host_memory_mode("staging", Pool(8, 8))
    with pytest.raises(HiCacheInputError, match="has no available_size"):
        check_host_memory_mode("buffer_only", object())


def test_buffer_mode_rate_limits_loads_alone() -> None:
    pool = Pool(size=20, free=0)
    limit = compute_load_capacity_limit(pool)
    assert limit == 18  # 0.9 of the host pool
    # the whole pool is write staging: no load holds any of it, a hit is admitted
    assert not is_load_rate_limited(pool, lambda: 20, limit)
    # staging charged to loads (no tree reporting it) parks the hit
    assert is_load_rate_limited(pool, None, limit)
    # loads alone at the limit: refused; one token under it: admitted
    assert is_load_rate_limited(pool, lambda: 2, limit)
    assert not is_load_rate_limited(pool, lambda: 3, limit)


def test_the_kv_verdict_rides_the_hits_min_and_a_silent_rank_makes_it_none() -> None:
    # this rank found 3 pages, the other 1: both the hit and the verdict agree on 1
    assert agree_pool_verdict(OtherRank((2, 1)), 6, 3) == (2, 1)
    # the other rank had no answer (its query failed): the hit is its 0, the verdict none
    assert agree_pool_verdict(OtherRank((0, -1)), 6, 3) == (0, None)
    # this rank had none: none whatever the other answered
    assert agree_pool_verdict(OtherRank((6, 3)), 0, None) == (0, None)


def test_a_belief_follows_the_storage_ack_and_refs_count_launched_writes() -> None:
    beliefs = StorageExistenceBeliefs()
    # two writes of the same page launched -> two refs; covered, not believed
    beliefs.track_inflight(["a", "b"])
    beliefs.track_inflight(["b"])
    assert beliefs.covered(["a", "b"]) and beliefs.view() == ((), (("a", 1), ("b", 2)))
    # the first ack teaches its pages and drops one ref each
    beliefs.finish_storage_write_ack(["a", "b"])
    assert beliefs.view() == (("a", "b"), (("b", 1),))
    # a reset drops what is in flight, never what is believed
    beliefs.clear_inflight()
    assert beliefs.view() == (("a", "b"), ())
    assert not beliefs.covered(["a", "c"])


def test_a_verdict_forgets_past_it_and_teaches_up_to_it() -> None:
    beliefs = StorageExistenceBeliefs()
    beliefs.finish_storage_write_ack(["a", "b", "c"])
    beliefs.heal_from_verdict(["a", "b", "c", "d"], 1)  # every rank holds "a" alone
    assert beliefs.view()[0] == ("a",)
    beliefs.heal_from_verdict(["a", "b", "c", "d"], 4)  # later every rank holds all four
    assert beliefs.view()[0] == ("a", "b", "c", "d")


def test_the_lru_bound_forgets_the_least_recently_touched() -> None:
    beliefs = StorageExistenceBeliefs(entries_max=2)
    beliefs.finish_storage_write_ack(["a", "b"])
    assert beliefs.covered(["a"])  # touch "a": "b" is now the oldest
    beliefs.finish_storage_write_ack(["c"])
    assert beliefs.view()[0] == ("a", "c")
