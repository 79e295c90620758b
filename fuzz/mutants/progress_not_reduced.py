"""Mutant: the prefetch sync publishes each rank's own progress, never the MIN over ranks.

Re-creates sglang#27010 (planned in #22607): ranks inserted and freed bounce pages by their
rank-local ``completed_tokens``. Must be caught by INV-21 (every published progress is the MIN of
the ranks' progress, the same on every rank): the published acks carry no rank reduction at all.
The focus draws two ranks.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_sync import PrefetchSync
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import PrefetchAck

NAME = "progress_not_reduced"
INVARIANTS = ("INV-21",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#27010 (plan #22607)"


class LocalSync(PrefetchSync):
    def reduce_prefetch_ack(self, ack: PrefetchAck) -> None:
        return None  # MUTATION: this rank's completed_tokens go out as they are


class Tier(StorageTier):
    prefetch_sync_class = LocalSync


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller, NAME, capabilities=CAPABILITIES - {"cp"}, refine_config=storage_focus()
    )
