"""Mutant: a backup that stopped at a failed batch acks every page of the operation anyway.

Re-creates sglang#39701 / #39444 / #38316: the backup stopped at its first failed batch but
acked normally, and buffer mode then believed unwritten pages were in L3. Must be caught by
INV-26 (a backup ack is exactly the stored prefix). The focus turns background faults on.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import StorageOperation

NAME = "backup_acks_every_page"
INVARIANTS = ("INV-26",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#39701, #39444, #38316"


class OptimisticBackup(Backup):
    def page_backup(self, operation: StorageOperation) -> None:
        super().page_backup(operation)
        # MUTATION: the ack claims every page, stored or not
        operation.completed_tokens = len(operation.hash_value) * self.tier.page_size


class Tier(StorageTier):
    backup_class = OptimisticBackup


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_faults=True),
    )
