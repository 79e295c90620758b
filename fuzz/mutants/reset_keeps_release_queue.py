"""Mutant: a reset starts a new epoch but carries the pending host releases over.

Re-creates sglang#26009 and bug class 15 (0.5.10 and the seed keep ``host_mem_release_queue``
across ``reset()``, so old entries are freed again after ``host_pool.clear()``); the planned
INV-18 mutant of the transfer path's reset, caught now that the machines drive storage. Must be
caught by INV-24 (after a reset every storage queue is empty): the storage driver checks every
rank's queues right after the reset.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus

NAME = "reset_keeps_release_queue"
INVARIANTS = ("INV-24",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#26009; bug class 15"


class Tier(StorageTier):
    def _begin_epoch(self) -> None:
        pending = self.queues.host_mem_release_queue.clear()
        super()._begin_epoch()
        for page in pending:  # MUTATION: stale releases survive into the new epoch
            self.queues.host_mem_release_queue.put(page)


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_batch_pages=1),
    )
