"""Mutant: a hit of more than one page is published one page short.

Re-creates sglang#40193 (a full L3 hit silently shortened to free host space) and #39147 (a
published endpoint that is not the agreed one). Must be caught by INV-29 (a published hit is the
MIN over ranks of each rank's leading run, served whole).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.hit_query import HitQuery
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import PrefetchOperation

NAME = "hit_shortened"
INVARIANTS = ("INV-29",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#40193, #39147"


class ShortHitQuery(HitQuery):
    def publish_hit(
        self, operation: PrefetchOperation, hash_value: list[str], storage_hit_count: int
    ) -> None:
        page = self.tier.page_size
        if storage_hit_count > page:
            storage_hit_count -= page  # MUTATION: the last page of the hit is dropped
        super().publish_hit(operation, hash_value, storage_hit_count)


class Tier(StorageTier):
    hit_query_class = ShortHitQuery


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1),
    )
