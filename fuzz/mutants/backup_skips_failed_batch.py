"""Mutant: a backup goes on past a failed batch (its ack still counts only the stored prefix).

Re-creates sglang#26886's outcome (pages of a chain in L3 without the pages before them, which no
prefetch can ever reach) through a "partial success" backup. Must be caught by INV-31 (L3 is
prefix-closed per chain). The focus draws one-page batches and background faults.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import StorageOperation

NAME = "backup_skips_failed_batch"
INVARIANTS = ("INV-31",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#26886"


class PressOnBackup(Backup):
    def page_backup(self, operation: StorageOperation) -> None:
        tier = self.tier
        page, batch = tier.page_size, tier.storage_batch_size
        host = operation.host_indices
        assert host is not None
        failed = False
        for start in range(0, len(operation.hash_value), batch):
            keys = operation.hash_value[start : start + batch]
            slots = host[start * page : (start + len(keys)) * page]
            ok = self.page_set(keys, slots, HiCacheStorageExtraInfo())
            failed = failed or not ok  # MUTATION: a failed batch does not stop the backup
            if ok and not failed:
                operation.completed_tokens += page * len(keys)


class Tier(StorageTier):
    backup_class = PressOnBackup


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_faults=True, storage_batch_pages=1),
    )
