"""Mutant: the prefetch IO counts every page of a batch, also the ones whose read failed.

Re-creates sglang#8901 (``completed_tokens`` raised before ``set_from_flat_data_page`` copied
the bytes, and a ``None`` page not handled): a page is counted before, here without, its bytes
landing in the bounce buffer. Must be caught by INV-19 (published progress counts only pages
whose bytes have landed): the storage driver compares the host bytes of every published page
with its oracle when the progress ack is applied; or by INV-34 (no progress past a hole) when
the page whose read failed is the first of the prefetch. The focus turns background faults on,
so a read fails often.
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

NAME = "increment_before_page_data"
INVARIANTS = ("INV-19", "INV-34")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#8901; bug class 13"


class CountingIO(PrefetchIO):
    def page_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        tier = self.tier
        backend = tier.require_backend("a prefetch transfer")
        targets = [tier.mem_pool_host.get_dummy_flat_data_page() for _ in hash_values]
        pages = backend.batch_get(hash_values, targets)
        for i, data in enumerate(pages):
            if data is not None:
                head = get_page_head(host_indices, i, tier.page_size)
                tier.mem_pool_host.set_from_flat_data_page(head, data)
        return len(hash_values)  # MUTATION: every page counted, landed or not


class Tier(StorageTier):
    prefetch_io_class = CountingIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_faults=True),
    )
