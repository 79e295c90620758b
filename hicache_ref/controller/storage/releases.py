"""Host pages handed back to the host pool: ``append_host_mem_release`` and who owns a page.

The tree frees host pages through ``host_mem_release_queue``, one entry per page (an empty
release queues nothing, sglang#11005). A page of a bounce buffer belongs to the prefetch's IO
until the request's final ack, except the pages every rank has published as complete: a release
that reaches into the unpublished rest of a buffer whose IO is still queued or running is
refused (INV-23, sglang#27550 / #31668), before anything is queued.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pages import require_page_aligned, split_pages
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import BoundedQueue


def io_owned_slots(operations: Iterable[PrefetchOperation]) -> dict[int, PrefetchOperation]:
    """Host slots an IO may still write: each busy prefetch's buffer past its published
    progress."""
    owned: dict[int, PrefetchOperation] = {}
    for operation in operations:
        host_indices = operation.host_indices
        if host_indices is None:
            continue
        for slot in host_indices[operation.completed_tokens :].tolist():
            owned[int(slot)] = operation
    return owned


def check_release_not_io_owned(
    host_indices: torch.Tensor, busy: Iterable[PrefetchOperation], what: str
) -> None:
    """Raise INV-23 if ``host_indices`` reach into a bounce buffer an IO may still write."""
    owned = io_owned_slots(busy)
    if not owned:
        return
    clash = [slot for slot in host_indices.tolist() if int(slot) in owned]
    # Verify no released slot is one an IO may still write
    if clash:
        operation = owned[int(clash[0])]
        raise InvariantViolation(
            "INV-23",
            f"{what} of host slots {clash[:4]} while prefetch {operation.request_id!r} op "
            f"{operation.id} may still write them (its IO has not sent the final ack; release "
            f"[{operation.completed_tokens}:] of its buffer when the completed_req ack is drained)",
        )


def queue_page_releases(
    queue: BoundedQueue[torch.Tensor], host_indices: torch.Tensor, page_size: int
) -> int:
    """Queue ``host_indices`` page by page; returns the number of pages queued."""
    if host_indices.numel() == 0:
        return 0  # an empty split must not queue an empty page (sglang#11005)
    require_page_aligned(host_indices, page_size, "released host_indices")
    pages = split_pages(host_indices, page_size)
    for page in pages:
        queue.put(page)
    return len(pages)


def drain_host_mem_release(
    queue: BoundedQueue[torch.Tensor], host_pool: StorageHostPool, limit: int | None = None
) -> list[int]:
    """Free up to ``limit`` queued pages (all if None) into ``host_pool`` in one call (the
    tree's ``_drain_release``); returns the freed slots."""
    count = queue.qsize() if limit is None else min(limit, queue.qsize())
    pages = [queue.get_nowait() for _ in range(count)]
    if not pages:
        return []
    slots = torch.cat(pages)
    host_pool.free(slots)
    return [int(s) for s in slots.tolist()]
