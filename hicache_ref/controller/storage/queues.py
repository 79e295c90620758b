"""The storage tier's queues, one record: who fills each one and who drains it.

In the order a prefetch and a backup flow through them (SGLang 0.5.23's names):

    prefetch_queue          tree -> hit query (T1)
    prefetch_hit_queue      T1 -> tree (rank-reduced hit count; the tree revokes or allocates)
    prefetch_buffer         tree -> IO (T2), with the bounce buffer in ``host_indices``
    prefetch_sync_queue     T2 -> sync (T3): one progress ack per batch, then the final ack
    ack_prefetch_queue      T3 -> tree (progress MIN-reduced over ranks)
    backup_queue            tree -> backup (T4)
    ack_backup_queue        T4 -> tree: exactly one ack per ``write_storage`` (INV-25)
    host_mem_release_queue  tree -> tree: host pages to free, one entry per page

Every queue has a bound its ``put`` checks (``BoundedQueue``). A reset empties them all
(INV-24); the tier creates fresh ones at every attach.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch

from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation, StorageOperation
from hicache_ref.storage.queues import BoundedQueue

STORAGE_OPS_MAX = 65_536
"""Bound on queued storage operations (and acks) per queue."""


@dataclass(frozen=True)
class StorageQueues:
    """The eight queues of one tier (one rank), created together and cleared together."""

    prefetch_queue: BoundedQueue[PrefetchOperation]
    prefetch_hit_queue: BoundedQueue[PrefetchOperation]
    prefetch_buffer: BoundedQueue[PrefetchOperation]
    prefetch_sync_queue: BoundedQueue[PrefetchAck]
    ack_prefetch_queue: BoundedQueue[PrefetchAck]
    backup_queue: BoundedQueue[StorageOperation]
    ack_backup_queue: BoundedQueue[StorageOperation]
    host_mem_release_queue: BoundedQueue[torch.Tensor]

    @classmethod
    def create(cls, host_pages: int) -> StorageQueues:
        """Fresh empty queues; a host page waits for release at most once, so the host pool's
        page count bounds the release queue."""
        acks_max = STORAGE_OPS_MAX * 2
        return cls(
            prefetch_queue=BoundedQueue(
                "prefetch_queue",
                STORAGE_OPS_MAX,
                "prefetch faster than storage answers; check prefetch_rate_limited()",
            ),
            prefetch_hit_queue=BoundedQueue(
                "prefetch_hit_queue", STORAGE_OPS_MAX, "drain the storage control queues every step"
            ),
            prefetch_buffer=BoundedQueue(
                "prefetch_buffer", STORAGE_OPS_MAX, "the prefetch IO step is not running"
            ),
            prefetch_sync_queue=BoundedQueue(
                "prefetch_sync_queue", acks_max, "the prefetch sync step is not running"
            ),
            ack_prefetch_queue=BoundedQueue(
                "ack_prefetch_queue", acks_max, "drain the storage control queues every step"
            ),
            backup_queue=BoundedQueue(
                "backup_queue", STORAGE_OPS_MAX, "the backup step is not running"
            ),
            ack_backup_queue=BoundedQueue(
                "ack_backup_queue", STORAGE_OPS_MAX, "drain the storage control queues every step"
            ),
            host_mem_release_queue=BoundedQueue(
                "host_mem_release_queue",
                max(1, host_pages),
                "drain it into the host pool every step; more means a page was released twice "
                "(INV-19)",
            ),
        )

    def by_name(self) -> dict[str, BoundedQueue[Any]]:
        return dict(self._named)

    @cached_property
    def _named(self) -> tuple[tuple[str, BoundedQueue[Any]], ...]:
        """The queues in field order (the fields are frozen, so once per tier attach)."""
        return tuple((name, getattr(self, name)) for name in QUEUE_NAMES)

    def sizes(self) -> dict[str, int]:
        """Every queue's length, by name (what a snapshot and INV-24 read)."""
        return {name: q.qsize() for name, q in self._named}

    def is_empty(self) -> bool:
        return not any(self.sizes().values())

    def wake_all(self) -> None:
        for q in self.by_name().values():
            q.wake_all()

    def clear(self) -> dict[str, list[Any]]:
        """Empty every queue; returns what each held, oldest first."""
        return {name: q.clear() for name, q in self.by_name().items()}


QUEUE_NAMES = tuple(f.name for f in fields(StorageQueues))
