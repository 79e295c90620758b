"""Mutant: a backup batch stores page i's key with the bytes of the next page of the batch.

Re-creates the class of "a get right after a put reads wrong data" (Mooncake) and bug class 21
(a page read back in the wrong format or position): what L3 returns under a key is not what was
written for it. Must be caught by INV-30 (every page read back holds the bytes the oracle expects
for its key), or by INV-32 when the tree drains the backup's ack before any read (the pages the
ack counts read back from L3 with other bytes). The focus draws batches of two pages.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.pages import get_page_head

NAME = "backup_pages_off_by_one"
INVARIANTS = ("INV-30", "INV-32")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "Mooncake get-after-put wrong data; bug class 21"


class RotatedBackup(Backup):
    def page_set(
        self,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> bool:
        tier = self.tier
        count = len(hash_values)
        pages = [
            # MUTATION: page (i + 1) of the batch goes out under key i
            tier.mem_pool_host.get_data_page(
                get_page_head(host_indices, (i + 1) % count, tier.page_size), True
            )
            for i in range(count)
        ]
        backend = tier.require_backend("a backup")
        return bool(backend.batch_set(hash_values, pages))


class Tier(StorageTier):
    backup_class = RotatedBackup


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_batch_pages=2),
    )
