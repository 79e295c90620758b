"""Buffer mode's storage existence beliefs: upstream's own class, run from the tree.

In ``buffer_only`` host memory (0.5.19+) the host pool is a staging buffer, so nothing on the
host says what L3 holds; the unified radix cache keeps that as *beliefs* instead: an LRU of the
page keys it believes stored (``mem_cache/buffer_mode/storage_existence_cache.py``), beside the
content of writes in flight from their D2H launch to their storage ack. A write whose pages are
covered is skipped; a stale belief is healed by the next drained hit query. Two shapes:

- ``pools`` (0.5.22+): per pool (``StorageExistenceCache.pool(name)``), with the in-flight
  refcounts and the ``PoolBeliefPolicy`` healing them; the hybrid controller hands the tree a
  rank-agreed verdict per pool (``PrefetchOperation.query_pool_hit_pages``, MIN-reduced beside
  the hit in ``_sync_prefetch_hit_query``), from which the beliefs are healed and learnt;
- ``flat`` (0.5.19 - 0.5.21): one LRU of ``(pool, key)``, the in-flight hashes kept by the
  pipeline itself (``inflight_backup_hashes``: here, by ``TreeBeliefs``), healed from the folded
  rank-agreed hit (``invalidate_beyond(KV, all_hash_values, storage_hit_count // page)``) at
  every drained hit, learning nothing there.

The harness's tree half (``driver/storage_buffer.py``) drives the tree's class unmodified, as
the buffer pipeline does. In the order a page meets it:

- ``beliefs_shape`` / ``has_buffer_beliefs``: which shape a tree has, if the harness drives it;
- ``existence_cache_module``: the tree's file, executed once per tree;
- ``TreeBeliefs``: one rank's ``storage_existence_cache``: ``covered`` (the write admission),
  ``track_inflight`` (the D2H launch), ``finish_storage_write_ack`` (the storage ack: taught
  unconditionally, the in-flight ref dropped), ``heal_from_query`` (a drained hit, as the
  release's ``_invalidate_absent_from_hit_query`` does), ``stage_completed_prefetch`` (a
  fetch's pages), ``clear`` / ``clear_inflight``; ``view`` reads what the class holds (its
  entries, and the in-flight refs, without an LRU touch) for INV-41.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXISTENCE_CACHE = Path("sglang/srt/mem_cache/buffer_mode/storage_existence_cache.py")
EXISTENCE_MODULE = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache"
HYBRID = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py")
SHAPE_POOLS = "pools"
SHAPE_FLAT = "flat"
SHAPE_MARKS = {SHAPE_POOLS: "query_pool_hit_pages", SHAPE_FLAT: "operation.all_hash_values"}
"""What the hybrid controller must hand the tree for each shape's heal: 0.5.22+'s per-pool
rank-agreed verdicts, 0.5.19 - 0.5.21's queried chain (the folded hit is every release's)."""


def beliefs_shape(tree: Path) -> str | None:
    """``pools`` or ``flat`` by the tree's ``StorageExistenceCache``, None without one."""
    if not (tree / EXISTENCE_CACHE).is_file():
        return None
    cls = getattr(existence_cache_module(tree), "StorageExistenceCache", None)
    if cls is None:
        return None
    if callable(getattr(cls, "pool", None)):
        return SHAPE_POOLS
    return SHAPE_FLAT if callable(getattr(cls, "invalidate_beyond", None)) else None


def has_buffer_beliefs(tree: Path, hybrid: types.ModuleType) -> bool:
    """The tree keeps beliefs of a shape the harness drives, and its hybrid controller takes
    ``host_memory_mode`` and hands the tree what that shape heals from (0.5.19+)."""
    shape = beliefs_shape(tree)
    controller = tree / HYBRID
    cls = getattr(hybrid, "HybridCacheController", None)
    if shape is None or cls is None or not controller.is_file():
        return False
    if "host_memory_mode" not in inspect.signature(cls.__init__).parameters:
        return False
    return SHAPE_MARKS[shape] in controller.read_text(errors="replace")


@functools.cache
def existence_cache_module(tree: Path) -> types.ModuleType:
    """The tree's ``storage_existence_cache`` module, executed once per tree (0.5.22+'s import of
    ``PoolHitPolicy`` comes from the ``hicache_storage`` the gate loaded for that tree)."""
    path = tree / EXISTENCE_CACHE
    module = types.ModuleType(EXISTENCE_MODULE)
    module.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _kv_pool() -> Any:
    """The KV pool's name as upstream's tree passes it (``PoolName.KV``)."""
    return sys.modules["sglang.srt.mem_cache.hicache_storage"].PoolName.KV


class TreeBeliefs:
    """One rank's ``storage_existence_cache`` (upstream's class), called as the buffer
    pipeline and the unified radix cache of its release call it, for the KV pool (the worlds it
    is drawn in store the KV pool alone)."""

    def __init__(self, tree: Path) -> None:
        module = existence_cache_module(tree)
        self.shape = beliefs_shape(tree)
        self.cache: Any = module.StorageExistenceCache()
        self.kv: Any = _kv_pool()
        self._policy: Any = None
        if self.shape == SHAPE_POOLS:
            self._policy = module.default_belief_policy(module.PoolHitPolicy.ALL_PAGES)
        self._inflight: Counter[str] = Counter()  # flat: the pipeline's in-flight hashes

    @property
    def learns_at_query(self) -> bool:
        """A drained hit query also teaches the pages up to its verdict (0.5.22+)."""
        return self.shape == SHAPE_POOLS

    def _pool(self) -> Any:
        return self.cache.pool(self.kv)

    def covered(self, keys: Sequence[str]) -> bool:
        """``_pool_covered``: every page believed stored or in flight (an LRU touch)."""
        if self.shape == SHAPE_POOLS:
            return bool(self._pool().covered(list(keys)))
        return bool(self.cache.covers_all(self.kv, list(keys), extra_cover=set(self._inflight)))

    def track_inflight(self, keys: Sequence[str]) -> None:
        """``_stage_backup_intent``, at the write's launch."""
        if self.shape == SHAPE_POOLS:
            self._pool().track_inflight(list(keys))
        else:
            self._inflight.update(keys)

    def finish_storage_write_ack(self, keys: Sequence[str]) -> None:
        """The storage ack (a rank-synced drain): taught unconditionally, one ref dropped."""
        if self.shape == SHAPE_POOLS:
            pool = self._pool()
            pool.add(list(keys))
            pool.untrack_inflight(list(keys))
            return
        self.cache.add(self.kv, list(keys))
        self._inflight.subtract(keys)
        self._inflight = +self._inflight

    def heal_from_query(self, operation: Any, page_size: int) -> None:
        """``_invalidate_absent_from_hit_query`` of a drained hit: 0.5.22+ from the KV pool's
        rank-agreed verdict (none: beliefs unchanged), 0.5.19 - 0.5.21 from the folded hit."""
        chain = getattr(operation, "all_hash_values", None)
        if chain is None:
            return  # this rank never queried
        if self.shape == SHAPE_FLAT:
            keep = int(operation.storage_hit_count) // page_size
            self.cache.invalidate_beyond(self.kv, list(chain), keep_pages=keep)
            return
        verdicts = dict(operation.query_pool_hit_pages)
        if self.kv in verdicts:
            pages = int(verdicts[self.kv])
            self._policy.heal_from_query(self._pool(), chain, chain, pages, evidence=True)

    def stage_completed_prefetch(self, keys: Sequence[str]) -> None:
        """A completed fetch is evidence for the pages it delivered."""
        if self.shape == SHAPE_POOLS:
            self._pool().add(list(keys))
        else:
            self.cache.add(self.kv, list(keys))

    def clear(self) -> None:
        """The clear endpoint (at rest: nothing in flight)."""
        self.cache.clear()
        self._inflight.clear()

    def clear_inflight(self) -> None:
        if self.shape == SHAPE_POOLS:
            self.cache.clear_inflight()
        self._inflight.clear()

    def view(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        """(the keys believed stored, the in-flight refs), sorted, read without an LRU touch
        (the class's own ``_entries`` and ``_inflight``: it has no read-only accessor)."""
        if self.shape == SHAPE_FLAT:
            entries = (key for pool, key in self.cache._entries if pool == self.kv)
            return tuple(sorted(entries)), tuple(sorted(self._inflight.items()))
        pool = self.cache._pools.get(self.kv)
        if pool is None:
            return (), ()
        return tuple(sorted(pool._entries)), tuple(sorted(pool._inflight.items()))
