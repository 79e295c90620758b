"""The backup step (T4, SGLang 0.5.23's ``backup_thread_func``): one write_storage per step.

A step takes the oldest operation of ``backup_queue`` and writes its pages batch by batch
(``_page_backup``), stopping at the first batch the backend refuses; ``completed_tokens`` is
then the stored prefix and nothing more (INV-26, sglang#39701), and no page is stored after a
hole, so L3 stays prefix-closed per chain (INV-31). A backend exception is logged
and ends the backup where it was (``_page_backup_or_log``), and the ack goes out in a
``finally``: exactly one ``ack_backup_queue`` entry per ``write_storage``, whatever the backend
does, so the tree always releases the node's host lock (INV-25, sglang#38427). A rank that
skips backups (an MLA rank other than 0: its KV is rank 0's) acks with nothing stored, unless
the node names a rank-sharded Mamba state (``side_window.py``): it stores that and acks the
span once every state page is stored. A node's independent side-pool window (SWA pages, a Mamba
state) is stored before its KV pages, each page under ``<key>.<pool>``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.controller.storage.side_window import backup_windows, window_transfers
from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import StorageOperation
from hicache_ref.storage.pages import get_page_head
from hicache_ref.storage.pool_transfers import count_pool_hits

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import StepTier

logger = logging.getLogger("hicache_ref.controller.storage")


class Backup:
    """T4's loop body."""

    kind = StorageStepKind.BACKUP

    def __init__(self, tier: StepTier) -> None:
        self.tier = tier

    def has_work(self) -> bool:
        return not self.tier.queues.backup_queue.empty()

    def step(self) -> StepResult:
        tier = self.tier
        operation = tier.queues.backup_queue.poll(0.0)
        if operation is None:
            return tier.idle_result(self.kind)
        tier.check_current_epoch(operation, "a backup")
        try:
            if not tier.backup_skip or window_transfers(operation):
                self.page_backup_or_log(operation)
        finally:  # after the write: every page the ack counts is in L3 (INV-32)
            tier.queues.ack_backup_queue.put(operation)
        return tier.result(
            self.kind, operation, tokens=operation.completed_tokens, acked=True, final=True
        )

    def page_backup_or_log(self, operation: StorageOperation) -> None:
        try:
            self.page_backup(operation)
        except InvariantViolation:
            raise
        except Exception:
            logger.info(
                "backup op %d failed after %d tokens",
                operation.id,
                operation.completed_tokens,
                exc_info=True,
            )

    def page_backup(self, operation: StorageOperation) -> None:
        """The node's windows first (``side_window.backup_windows``), then its KV pages batch
        by batch, stopping at the first failed batch. A rank that skips the replicated KV
        acks the span once its rank-sharded state is stored, else nothing."""
        tier = self.tier
        windows_stored = backup_windows(tier, operation)
        if tier.backup_skip:
            span = len(operation.hash_value) * tier.page_size
            operation.completed_tokens = span if windows_stored else 0
            return
        page_size = tier.page_size
        prefix_keys = operation.prefix_keys
        host_indices = operation.host_indices
        assert host_indices is not None  # write_storage refuses a backup without host slots
        for start in range(0, len(operation.hash_value), tier.storage_batch_size):
            batch_hashes = operation.hash_value[start : start + tier.storage_batch_size]
            batch_host_indices = host_indices[
                start * page_size : (start + len(batch_hashes)) * page_size
            ]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            if not self.page_set(batch_hashes, batch_host_indices, extra_info):
                logger.info("backup op %d: %d pages failed", operation.id, len(batch_hashes))
                break
            if prefix_keys is not None:
                prefix_keys = (*prefix_keys, *batch_hashes)  # a new tuple (bug class 20)
            operation.completed_tokens += page_size * len(batch_hashes)

    def page_set(
        self,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> bool:
        """Write one batch of host pages (flat, layout-independent) to the backend: every
        sidecar pool's pages first, then the KV pages only if they all landed, so no KV page
        of this batch is stored without its sidecars (INV-37)."""
        tier = self.tier
        backend = tier.require_backend("a backup")
        sidecars = tier.sidecar_transfers(hash_values, host_indices)
        if sidecars:
            results = backend.batch_set_v2(sidecars, extra_info)
            if any(
                count_pool_hits({t.name: results.get(t.name, [])}).get(t.name, 0) < len(hash_values)
                for t in sidecars
            ):
                return False
        pages = [
            tier.mem_pool_host.get_data_page(get_page_head(host_indices, i, tier.page_size), True)
            for i in range(len(hash_values))
        ]
        return bool(backend.batch_set(hash_values, pages))
