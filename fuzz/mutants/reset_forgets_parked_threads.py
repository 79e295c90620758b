"""Mutant: reset forgets the storage threads instead of stopping and joining them.

Re-creates sglang#36882 / #27501 (reset leaked the old IO thread, which then acted on the new
epoch): the tier drops its list of threads and starts the next epoch's, so a thread parked
inside its loop body when the reset came stays parked and runs again later. Must be caught by
INV-35 (no parked thread of an old epoch is granted after a reset) or INV-24 (nothing of an old
epoch acts again); only schedule points park a thread inside its body.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus

NAME = "reset_forgets_parked_threads"
INVARIANTS = ("INV-35", "INV-24")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#36882, #27501"


class Tier(StorageTier):
    def reset(self) -> None:
        forget = getattr(self.executor, "_threads", None)
        if isinstance(forget, list):
            forget.clear()  # MUTATION: the old threads are neither stopped nor joined
        self._begin_epoch()
        self.prefetch_tokens_occupied = 0
        if self.enable_storage:
            self.executor.start(self.epoch)


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_points=True, storage_batch_pages=1),
    )
