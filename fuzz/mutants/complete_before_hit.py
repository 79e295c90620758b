"""Mutant: a prefetch counts as complete when its progress covers its hit keys, hit or not.

Re-creates sglang#9397: ``wait_complete`` compared ``completed_tokens`` with
``len(hash_value) * page_size`` before the hit query had filled ``hash_value``, so 0 == 0 was a
completion and the prefetch was terminated with nothing fetched. Must be caught by INV-22 (no
verdict "complete" before the hit result was published and drained). The focus draws the
``wait_complete`` policy.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import PrefetchOperation

NAME = "complete_before_hit"
INVARIANTS = ("INV-22",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#9397"


class Tier(StorageTier):
    def is_prefetch_complete(self, operation: PrefetchOperation) -> bool:
        # MUTATION: no hit yet means no keys, and 0 >= 0
        return operation.completed_tokens >= len(operation.hash_value) * self.page_size


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_policy="wait_complete"),
    )
