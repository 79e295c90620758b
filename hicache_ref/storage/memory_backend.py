"""``MemoryStorage``: flat pages in memory, one client per rank over one shared ``MemoryStore``.

A ``MemoryStore`` is one L3 for a whole world (what a shared file system or Mooncake is): every
rank's ``MemoryStorage`` writes into it under keys of its own namespace, so ranks never share a
stored key and ``clear`` removes only the clearing client's namespace (INV-28). The store
remembers which rank wrote each key, for the harness's checks.

Pages are cloned on the way in and copied on the way out, so the store never aliases host-pool
memory: a later write to the host slot cannot change what storage holds, and a caller that
mutates a page it read cannot change the stored copy.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig, copy_page_bytes


class MemoryStore:
    """A thread-safe dict from stored key to a private copy of a flat page, and its writer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: dict[str, torch.Tensor] = {}
        self.writer_of: dict[str, int] = {}

    def keys(self) -> list[str]:
        with self.lock:
            return list(self.pages)

    def __len__(self) -> int:
        with self.lock:
            return len(self.pages)


class MemoryStorage(HiCacheStorage):
    """One rank's client of a ``MemoryStore`` (a private store when none is given)."""

    def __init__(
        self, config: HiCacheStorageConfig | None = None, store: MemoryStore | None = None
    ) -> None:
        super().__init__(config)
        self.store = store if store is not None else MemoryStore()
        self._stats = {"get_hits": 0, "get_misses": 0, "sets": 0, "set_skips": 0}

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        store = self.store
        with store.lock:
            page = store.pages.get(self._storage_key(key))
            self._stats["get_hits" if page is not None else "get_misses"] += 1
        if page is None:
            return None
        if target_location is None:
            return page.clone()
        return copy_page_bytes(page, target_location)

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        if value is None:
            raise HiCacheInputError(
                f"MemoryStorage.set({key!r}) needs a value (zero-copy writes are not supported)"
            )
        storage_key = self._storage_key(key)
        copy = value.detach().to("cpu", copy=True).contiguous()
        store = self.store
        with store.lock:
            if storage_key in store.pages:
                self._stats["set_skips"] += 1
                return True  # first writer wins: equal keys mean equal content
            store.pages[storage_key] = copy
            store.writer_of[storage_key] = self.config.tp_rank
            self._stats["sets"] += 1
        return True

    def exists(self, key: str) -> bool:
        store = self.store
        with store.lock:
            return self._storage_key(key) in store.pages

    def clear(self) -> None:
        """Drop this client's namespace, and only that (INV-28)."""
        suffix = f"_{self.namespace}"
        store = self.store
        with store.lock:
            for stored in [k for k in store.pages if k.endswith(suffix)]:
                del store.pages[stored]
                store.writer_of.pop(stored, None)

    def get_stats(self) -> Mapping[str, int]:
        with self.store.lock:
            return dict(self._stats)

    def __len__(self) -> int:
        suffix = f"_{self.namespace}"
        with self.store.lock:
            return sum(1 for k in self.store.pages if k.endswith(suffix))
