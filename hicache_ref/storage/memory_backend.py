"""``MemoryStorage``: an in-process dict of flat pages, the simplest real backend.

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


class MemoryStorage(HiCacheStorage):
    """A thread-safe dict from storage key to a private copy of a flat page."""

    def __init__(self, config: HiCacheStorageConfig | None = None) -> None:
        super().__init__(config)
        self._pages: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._stats = {"get_hits": 0, "get_misses": 0, "sets": 0, "set_skips": 0}

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        with self._lock:
            page = self._pages.get(self._storage_key(key))
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
        with self._lock:
            if storage_key in self._pages:
                self._stats["set_skips"] += 1
                return True  # first writer wins: equal keys mean equal content
            self._pages[storage_key] = copy
            self._stats["sets"] += 1
        return True

    def exists(self, key: str) -> bool:
        with self._lock:
            return self._storage_key(key) in self._pages

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()

    def get_stats(self) -> Mapping[str, int]:
        with self._lock:
            return dict(self._stats)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)
