"""Mutant: a backend exception during a backup ends the backup without its ack.

Re-creates sglang#38427: an exception in the backend killed the backup thread, acks stopped and
the nodes' host locks leaked. Must be caught by INV-25 (exactly one ack per ``write_storage``,
whatever the backend does): at quiescence the backup was never acked. The focus turns background
faults on (they include exceptions).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.records import StepResult
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus

NAME = "backup_exception_drops_ack"
INVARIANTS = ("INV-25",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#38427"


class FragileBackup(Backup):
    def step(self) -> StepResult:
        tier = self.tier
        operation = tier.queues.backup_queue.poll(0.0)
        if operation is None:
            return tier.idle_result(self.kind)
        try:
            if not tier.backup_skip:
                self.page_backup(operation)
        except Exception:
            return tier.result(self.kind, operation, tokens=0, acked=False)  # MUTATION: no ack
        tier.queues.ack_backup_queue.put(operation)
        return tier.result(self.kind, operation, tokens=operation.completed_tokens, acked=True)


class Tier(StorageTier):
    backup_class = FragileBackup


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1, storage_faults=True),
    )
