"""Buffer mode's storage existence beliefs: what the tree believes L3 holds (INV-41).

In ``buffer_only`` host memory (``buffer_mode.py``) no host page says what L3 holds, so SGLang's
tree keeps *beliefs* of it (0.5.22+'s ``StorageExistenceCache``, one per pool): the page keys it
believes stored, and the keys of writes in flight from their launch to their storage ack. A
write whose pages are all believed stored or in flight is skipped. The beliefs are advisory: a
stale positive costs skipped write-backs until a query heals it, a miss one redundant write.
Every rank must believe alike, so every mutation is fed a rank-agreed input (a storage ack the
tree drains on every rank, the hit query's verdict MIN-reduced over ranks, a completed fetch).

SGLang's tree owns them; the reference has no tree, so its controller holds them for the tree
in buffer mode (``HiCacheController.storage_existence_cache``), as it holds an independent side
pool, and the harness's tree half drives them (``harness/driver/storage_buffer.py``). In the
order a page meets them:

- ``covered``: the write admission (every page believed stored or in flight; an LRU touch);
- ``track_inflight``: a write's launch (one ref per page and write);
- ``finish_storage_write_ack``: the storage ack: taught whatever the backend did (a failed
  write is a stale positive until a query heals it: what keeps admission TP-deterministic),
  one ref dropped;
- ``heal_from_query``: a drained hit query: from the KV pool's rank-agreed verdict, pages past
  it forgotten (``forget_beyond``) and pages up to it learnt; no verdict, no change;
- ``stage_completed_prefetch``: a completed fetch teaches the pages it delivered;
- ``clear`` (L3 emptied), ``clear_inflight`` (a reset: the dropped writes reach no ack);
- ``view``: what they hold, read without an LRU touch, for INV-41.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from hicache_ref.storage.pool_transfers import KV_POOL

EXISTENCE_ENTRIES_MAX = 512 * 1024
"""Keys one pool believes at most (the oldest touched is forgotten past it: a miss costs one
redundant write); SGLang's bound."""


class PoolBeliefs:
    """One pool's bounded LRU of page keys believed stored, and its in-flight refs."""

    def __init__(self, entries_max: int = EXISTENCE_ENTRIES_MAX) -> None:
        assert entries_max >= 1
        self.entries_max = entries_max
        self.entries: OrderedDict[str, None] = OrderedDict()
        self.inflight: Counter[str] = Counter()

    def learn(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.entries[key] = None
            self.entries.move_to_end(key)
        while len(self.entries) > self.entries_max:
            self.entries.popitem(last=False)

    def covered(self, keys: Iterable[str]) -> bool:
        """Every key believed stored (touched) or in flight."""
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)
            elif key not in self.inflight:
                return False
        return True

    def forget_beyond(self, chain: Sequence[str], keep_pages: int) -> None:
        """Forget every key of ``chain`` past its leading ``keep_pages``."""
        assert keep_pages >= 0
        for key in chain[keep_pages:]:
            self.entries.pop(key, None)

    def untrack(self, keys: Iterable[str]) -> None:
        self.inflight.subtract(keys)
        self.inflight = +self.inflight  # a key whose refs reached zero is no longer in flight


class StorageExistenceBeliefs:
    """One rank's beliefs, per storage pool (buffer-mode worlds store the KV pool alone)."""

    learns_at_query = True
    """A drained hit query's agreed verdict teaches the pages up to it (SGLang 0.5.22+)."""

    def __init__(self, entries_max: int = EXISTENCE_ENTRIES_MAX) -> None:
        self.entries_max = entries_max
        self.pools: dict[str, PoolBeliefs] = {}

    def pool(self, name: str = KV_POOL) -> PoolBeliefs:
        beliefs = self.pools.get(name)
        if beliefs is None:
            beliefs = self.pools[name] = PoolBeliefs(self.entries_max)
        return beliefs

    # -- the write path ----------------------------------------------------------------------------
    def covered(self, keys: Sequence[str]) -> bool:
        return self.pool().covered(keys)

    def track_inflight(self, keys: Sequence[str]) -> None:
        self.pool().inflight.update(keys)

    def finish_storage_write_ack(self, keys: Sequence[str]) -> None:
        pool = self.pool()
        pool.learn(keys)
        pool.untrack(keys)

    # -- the read path -----------------------------------------------------------------------------
    def heal_from_query(self, operation: Any, page_size: int) -> None:
        """A drained hit query (SGLang's ``_invalidate_absent_from_hit_query``): no change
        without a chain this rank queried or without the KV pool's agreed verdict."""
        assert page_size >= 1
        chain = getattr(operation, "all_hash_values", None)
        verdicts: dict[str, int] = getattr(operation, "query_pool_hit_pages", {})
        if getattr(operation, "deadline_expired", False) or chain is None:
            return  # a cut query's MIN is over skipped lookups: no verdict
        if KV_POOL not in verdicts:
            return  # some rank had no answer: nothing every rank verified
        self.heal_from_verdict(list(chain), int(verdicts[KV_POOL]))

    def heal_from_verdict(self, chain: Sequence[str], hit_pages: int) -> None:
        """Every rank verified ``chain[:hit_pages]`` and found the page after it missing."""
        pool = self.pool()
        pool.forget_beyond(chain, hit_pages)
        pool.learn(chain[:hit_pages])

    def stage_completed_prefetch(self, keys: Sequence[str]) -> None:
        self.pool().learn(keys)

    # -- reset, clear, evidence --------------------------------------------------------------------
    def clear(self) -> None:
        for pool in self.pools.values():
            pool.entries.clear()
            pool.inflight.clear()

    def clear_inflight(self) -> None:
        for pool in self.pools.values():
            pool.inflight.clear()

    def view(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
        """(the KV keys believed stored, the in-flight refs), sorted, without an LRU touch."""
        pool = self.pools.get(KV_POOL)
        if pool is None:
            return (), ()
        return tuple(sorted(pool.entries)), tuple(sorted(pool.inflight.items()))
