"""Mutant: the backup puts its ack before it writes the pages the ack counts.

Re-creates the window of sglang#39701's class at the thread level: the ack reaches
``ack_backup_queue`` first, the tree drains it (releases the host lock, frees the source pages)
while the write has not run yet. Must be caught by INV-32 (every page an acked backup counts is
readable from L3 when the tree drains the ack), or by INV-26 when the tree drains the ack
before the harness saw the backup's body end (nothing stored yet for the ack to report). Only a
world with schedule points opens the window (a whole loop body is atomic otherwise).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.records import StepResult
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus

NAME = "backup_acks_before_write"
INVARIANTS = ("INV-32", "INV-26")  # INV-26: drained before the backup's body ended
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#39701 (window)"


class EarlyAckBackup(Backup):
    def step(self) -> StepResult:
        tier = self.tier
        operation = tier.queues.backup_queue.poll(0.0)
        if operation is None:
            return tier.idle_result(self.kind)
        tier.check_current_epoch(operation, "a backup")
        operation.completed_tokens = len(operation.hash_value) * tier.page_size  # MUTATION:
        tier.queues.ack_backup_queue.put(operation)  # the ack goes out before the write
        if not tier.backup_skip:
            done = operation.completed_tokens
            operation.completed_tokens = 0
            self.page_backup_or_log(operation)
            operation.completed_tokens = done
        return tier.result(
            self.kind, operation, tokens=operation.completed_tokens, acked=True, final=True
        )


class Tier(StorageTier):
    backup_class = EarlyAckBackup


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=2, storage_points=True, storage_batch_pages=1),
    )
