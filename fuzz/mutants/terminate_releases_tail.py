"""Mutant: ``terminate_prefetch`` releases the unfetched rest of the bounce buffer itself.

Re-creates sglang#27550 / #31668 (a prefetch terminated, or its sidecar buffer released, while
the IO thread still wrote its host pages) in 0.5.10's shape, where the IO side released
``host_indices[completed:]`` on its own schedule. Must be caught by INV-23 (the IO owns the
unpublished pages until the request's final ack): the tree frees those pages from the release
queue before the final ack arrived. The queue is written directly, past the tier's own guard.
Where the tier releases the same tail itself before any IO step ran (a detach right after the
hit query), the pool refuses the second release as a double free (INV-05), the same bug seen
from the host pool's side.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.releases import queue_page_releases
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import PrefetchOperation

NAME = "terminate_releases_tail"
INVARIANTS = ("INV-23", "INV-05")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#27550, #31668"


class Tier(StorageTier):
    def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        completed, keys = super().terminate_prefetch(operation)
        host = operation.host_indices
        if host is not None:
            # MUTATION: the tail goes back now, while the IO may still write it
            queue_page_releases(
                self.queues.host_mem_release_queue, host[completed:], self.page_size
            )
        return completed, keys


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_batch_pages=1),
    )
