"""Buffer mode's storage existence beliefs: upstream's own class, run from the tree.

In ``buffer_only`` host memory (0.5.19+) the host pool is a staging buffer, so nothing on the
host says what L3 holds; the unified radix cache keeps that as *beliefs* instead: per storage
pool an LRU of the page keys it believes stored, plus the content of writes in flight from their
D2H launch to their storage ack (``mem_cache/buffer_mode/storage_existence_cache.py``). A write
whose pages are covered is skipped; a stale belief is healed by the next hit query's rank-agreed
verdict. 0.5.22+ keep them per pool (``StorageExistenceCache.pool(name)``, with in-flight
refcounts and the ``PoolBeliefPolicy`` healing them) and the hybrid controller hands the tree a
rank-agreed verdict per pool (``PrefetchOperation.query_pool_hit_pages``, MIN-reduced with the hit
in ``_sync_prefetch_hit_query``). 0.5.19 - 0.5.21 keep one flat LRU of ``(pool, key)`` without
in-flight content and heal at other places of their radix caches: not modelled (the release
matrix says so).

The harness's tree half (``driver/storage_buffer.py``) drives the tree's class unmodified, as
the buffer pipeline does. In the order a page meets it:

- ``has_pool_beliefs``: whether a tree has what the harness drives (0.5.22+);
- ``existence_cache_module``: the tree's file, executed once per tree;
- ``TreeBeliefs``: one rank's ``storage_existence_cache``: ``covered`` (the write admission),
  ``track_inflight`` (the D2H launch), ``finish_storage_write_ack`` (the storage ack: taught
  unconditionally, the in-flight ref dropped), ``heal_from_query`` (a drained hit query's KV
  verdict, through upstream's own ``default_belief_policy``), ``stage_completed_prefetch`` (a
  fetch's pages), ``clear`` / ``clear_inflight``; ``view`` reads what the class holds (its
  entries and in-flight refs, without an LRU touch) for INV-41.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXISTENCE_CACHE = Path("sglang/srt/mem_cache/buffer_mode/storage_existence_cache.py")
EXISTENCE_MODULE = "sglang.srt.mem_cache.buffer_mode.storage_existence_cache"
HYBRID = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py")
POOL_VERDICTS = "query_pool_hit_pages"
"""0.5.22+'s hybrid controller: each pool's rank-agreed hit-query boundary, which the tree heals
its beliefs from (``_invalidate_absent_from_hit_query``)."""


def has_pool_beliefs(tree: Path, hybrid: types.ModuleType | None = None) -> bool:
    """The tree keeps per-pool beliefs (``StorageExistenceCache.pool``) and its hybrid
    controller hands the tree per-pool query verdicts: 0.5.22+."""
    path, controller = tree / EXISTENCE_CACHE, tree / HYBRID
    if not path.is_file() or not controller.is_file():
        return False
    if POOL_VERDICTS not in controller.read_text(errors="replace"):
        return False
    if hybrid is not None and not hasattr(hybrid, "HybridCacheController"):
        return False
    cls = getattr(existence_cache_module(tree), "StorageExistenceCache", None)
    return callable(getattr(cls, "pool", None))


@functools.cache
def existence_cache_module(tree: Path) -> types.ModuleType:
    """The tree's ``storage_existence_cache`` module, executed once per tree (its import of
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
    pipeline and the unified radix cache call it, for the KV pool (the worlds it is drawn in
    store the KV pool alone)."""

    def __init__(self, tree: Path) -> None:
        module = existence_cache_module(tree)
        self.cache: Any = module.StorageExistenceCache()
        self._policy: Any = module.default_belief_policy(module.PoolHitPolicy.ALL_PAGES)
        self.kv: Any = _kv_pool()

    def _pool(self) -> Any:
        return self.cache.pool(self.kv)

    def covered(self, keys: Sequence[str]) -> bool:
        """``_pool_covered``: every page believed stored or in flight (an LRU touch)."""
        return bool(self._pool().covered(list(keys)))

    def track_inflight(self, keys: Sequence[str]) -> None:
        """``_stage_backup_intent``, at the write's launch."""
        self._pool().track_inflight(list(keys))

    def finish_storage_write_ack(self, keys: Sequence[str]) -> None:
        """The storage ack (a rank-synced drain): taught unconditionally, one ref dropped."""
        pool = self._pool()
        pool.add(list(keys))
        pool.untrack_inflight(list(keys))

    def heal_from_query(self, chain: Sequence[str], verdicts: dict[Any, int]) -> None:
        """``_invalidate_absent_from_hit_query``: the KV pool's rank-agreed boundary (none: no
        rank-agreed evidence, beliefs unchanged)."""
        if self.kv not in verdicts:
            return
        self._policy.heal_from_query(
            self._pool(), list(chain), list(chain), int(verdicts[self.kv]), evidence=True
        )

    def stage_completed_prefetch(self, keys: Sequence[str]) -> None:
        """A completed fetch is evidence for the pages it delivered."""
        self._pool().add(list(keys))

    def clear(self) -> None:
        self.cache.clear()

    def clear_inflight(self) -> None:
        self.cache.clear_inflight()

    def view(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        """(the keys believed stored, the in-flight refs), sorted, read without an LRU touch
        (the class's own ``_entries`` and ``_inflight``: it has no read-only accessor)."""
        pool = self.cache._pools.get(self.kv)
        if pool is None:
            return (), ()
        return tuple(sorted(pool._entries)), tuple(sorted(pool._inflight.items()))
