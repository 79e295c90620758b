"""The prefetch IO step (T2, SGLang 0.5.23's ``prefetch_io_aux_func`` / ``_page_transfer``).

One step moves *one batch* of one prefetch from storage into its bounce buffer and emits one
cumulative ``PrefetchAck(completed_tokens=...)`` for it, even when the batch failed or the
prefetch was terminated: every rank emits the same number of acks, so the sync step's
reductions pair up (INV-20). The step that handles the last batch also emits the final
``PrefetchAck(completed_req=True)``, in a ``finally``: until then the IO owns every page of the
bounce buffer it has not published (INV-23). A page is counted only after its bytes were set
into the host pool (INV-19, sglang#8901).

After the last batch a prefetch that names an independent side pool's window reads it, only
when every KV page of the hit landed, and emits one ``PrefetchAck(pool_hits=...)`` on every
rank alike (``side_window.py``).

The transfer in progress is this component's state (``current``); a reset drops it, so no
batch of an old epoch runs after a reset (INV-24).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.controller.storage.side_window import read_windows, sync_trailing_keys
from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation
from hicache_ref.storage.pages import get_page_head, require_page_aligned
from hicache_ref.storage.pool_transfers import PoolTransfer, count_pool_hits

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import StepTier

logger = logging.getLogger("hicache_ref.controller.storage")


@dataclass
class Transfer:
    """One prefetch being transferred: where the next batch starts and how far it got."""

    operation: PrefetchOperation
    next_page: int = 0
    completed_pages: int = 0
    all_success: bool = True
    prefix_keys: tuple[str, ...] | None = None


class PrefetchIO:
    """T2's loop body: one batch per step."""

    kind = StorageStepKind.IO

    def __init__(self, tier: StepTier) -> None:
        self.tier = tier
        self.current: Transfer | None = None

    def has_work(self) -> bool:
        return self.current is not None or not self.tier.queues.prefetch_buffer.empty()

    def busy_operations(self) -> list[PrefetchOperation]:
        """Prefetches whose IO may still write their bounce buffers (queued or in transfer)."""
        queued = self.tier.queues.prefetch_buffer.snapshot()
        current = self.current
        return queued + ([current.operation] if current is not None else [])

    def reset(self) -> None:
        self.current = None

    def step(self) -> StepResult:
        tier = self.tier
        transfer = self.current
        if transfer is None:
            operation = tier.queues.prefetch_buffer.poll(0.0)
            if operation is None:
                return tier.idle_result(self.kind)
            transfer = self.begin(operation)
        operation = transfer.operation
        tier.check_current_epoch(operation, "a prefetch transfer")
        final = True
        try:
            final = self.transfer_batch(transfer)
            if final:  # after every KV page: the windows, all or nothing (side_window.py)
                self.read_windows(operation, transfer.completed_pages)
        finally:
            if final:
                self.current = None
                self.finish(operation)
        return tier.result(
            self.kind,
            operation,
            tokens=transfer.completed_pages * tier.page_size,
            acked=True,
            final=final,
        )

    def begin(self, operation: PrefetchOperation) -> Transfer:
        """Check the bounce buffer the tree gave the prefetch and make it current."""
        page_size = self.tier.page_size
        host_indices = operation.host_indices
        # Verify a bounce buffer of whole pages covering exactly the published hit (INV-29)
        if host_indices is None or host_indices.numel() != len(operation.hash_value) * page_size:
            got = "none" if host_indices is None else f"{host_indices.numel()} tokens"
            raise InvariantViolation(
                "INV-29",
                f"prefetch {operation.request_id!r} op {operation.id} reached the IO step with "
                f"bounce buffer {got} for a hit of {len(operation.hash_value)} pages (allocate "
                "exactly storage_hit_count tokens, after cutting hash_value to them)",
            )
        require_page_aligned(host_indices, page_size, "prefetch bounce buffer")
        self.current = Transfer(operation, prefix_keys=operation.prefix_keys)
        return self.current

    def transfer_batch(self, transfer: Transfer) -> bool:
        """Transfer the next batch (or skip it after a failure/termination), emit its ack;
        returns whether that was the last batch."""
        tier = self.tier
        operation = transfer.operation
        page_size = tier.page_size
        batch_hashes = operation.hash_value[
            transfer.next_page : transfer.next_page + tier.storage_batch_size
        ]
        if transfer.all_success and operation.is_terminated():  # before every read (INV-33)
            transfer.all_success = False
        if transfer.all_success and batch_hashes:
            host_indices = operation.host_indices
            assert host_indices is not None  # checked by begin
            batch_host_indices = host_indices[
                transfer.next_page * page_size : (transfer.next_page + len(batch_hashes))
                * page_size
            ]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=transfer.prefix_keys)
            hit_pages = self.page_get_or_log(
                operation, batch_hashes, batch_host_indices, extra_info
            )
            if hit_pages != len(batch_hashes):
                transfer.all_success = False
            if transfer.prefix_keys is not None:
                transfer.prefix_keys = (*transfer.prefix_keys, *batch_hashes)  # bug class 20
            transfer.completed_pages += hit_pages
        transfer.next_page += len(batch_hashes)
        tier.queues.prefetch_sync_queue.put(
            PrefetchAck(
                rid=operation.request_id,
                operation=operation,
                completed_tokens=transfer.completed_pages * page_size,
            )
        )
        return transfer.next_page >= len(operation.hash_value)

    def read_windows(self, operation: PrefetchOperation, kv_pages: int) -> None:
        """The prefetch's windows once every KV page of the hit landed; one pool-hit ack."""
        read_windows(self.tier, operation, kv_pages, self.sync_trailing_keys)

    def sync_trailing_keys(
        self, transfers: list[PoolTransfer], hashes: Sequence[str], hit_pages: int
    ) -> None:
        """Re-align each window to the last pages of the hit served (``_sync_trailing_keys``)."""
        sync_trailing_keys(self.tier, transfers, hashes, hit_pages)

    def finish(self, operation: PrefetchOperation) -> None:
        """The final ack: from its drain on, the tree owns the rest of the bounce buffer."""
        self.tier.queues.prefetch_sync_queue.put(
            PrefetchAck(rid=operation.request_id, operation=operation, completed_req=True)
        )

    def page_get_or_log(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        """``page_get``, with a backend exception counted as a failed batch (never a dead IO
        thread, sglang#27501)."""
        try:
            return self.page_get(operation, hash_values, host_indices, extra_info)
        except InvariantViolation:
            raise
        except Exception:
            logger.info(
                "prefetch transfer failed for request %s", operation.request_id, exc_info=True
            )
            return 0

    def page_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        """Read pages into host slots; the leading pages whose bytes were set (sglang#8901)."""
        tier = self.tier
        backend = tier.require_backend("a prefetch transfer")
        host_pool = tier.mem_pool_host
        targets = [host_pool.get_dummy_flat_data_page() for _ in hash_values]
        page_data = backend.batch_get(hash_values, targets)
        count = 0
        for i, key in enumerate(hash_values):
            data = page_data[i] if i < len(page_data) else None
            if data is None:  # a hole: nothing after it is counted (INV-34)
                logger.info("prefetch %s: page %s not retrieved", operation.request_id, key)
                break
            if operation.is_terminated():
                break
            # Set the bytes BEFORE counting the page: a counted page may be read at once
            host_pool.set_from_flat_data_page(get_page_head(host_indices, i, tier.page_size), data)
            count += 1
        return self.sidecar_get(operation, hash_values[:count], host_indices, extra_info)

    def sidecar_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        """The pages of ``hash_values`` (the KV pages that landed) whose every sidecar page
        landed too: a page is counted whole or not at all (INV-37). Nothing is read once the
        prefetch is terminated (INV-33), and then nothing of the batch counts."""
        tier = self.tier
        count = len(hash_values)
        sidecars = tier.sidecar_transfers(hash_values, host_indices[: count * tier.page_size])
        if not sidecars or not count:
            return count
        if operation.is_terminated():
            return 0
        results = tier.require_backend("a prefetch transfer").batch_get_v2(sidecars, extra_info)
        for transfer in sidecars:
            count = min(
                count,
                count_pool_hits({transfer.name: results.get(transfer.name, [])})[transfer.name],
            )
        return count
