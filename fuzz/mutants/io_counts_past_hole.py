"""Mutant: the prefetch IO skips a page it could not read and counts the pages after it.

Re-creates LMCache #2966's class (and a wrong ``continue`` in a batch loop): one page of a batch
comes back empty, the loop goes on, and the batch's count includes the pages after the hole, so
the tree inserts a bounce page that holds no fetched bytes. Must be caught by INV-34 (published
progress never counts a page past a hole); schedule points draw the hole per call.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pages import get_page_head

NAME = "io_counts_past_hole"
INVARIANTS = ("INV-34", "INV-19")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "LMCache #2966 (class)"


class HoleBlindIO(PrefetchIO):
    def page_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        tier = self.tier
        backend = tier.require_backend("a prefetch transfer")
        host_pool = tier.mem_pool_host
        targets = [host_pool.get_dummy_flat_data_page() for _ in hash_values]
        page_data = backend.batch_get(hash_values, targets)
        count = 0
        for i in range(len(hash_values)):
            data = page_data[i] if i < len(page_data) else None
            if data is None:
                continue  # MUTATION: past the hole: the pages after it are counted
            host_pool.set_from_flat_data_page(get_page_head(host_indices, i, tier.page_size), data)
            count += 1
        return count


class Tier(StorageTier):
    prefetch_io_class = HoleBlindIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=2, storage_points=True, storage_batch_pages=2),
    )
