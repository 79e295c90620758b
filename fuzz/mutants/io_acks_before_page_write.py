"""Mutant: the prefetch IO puts a batch's progress ack before it writes the batch's pages.

The window of sglang#8901's class at the page level: the ack counts pages whose bytes are still
only in the read's landing buffers. The sync thread drains it and publishes the progress, the
tree settles the prefetch on it and reads the host pages, and only then do the bytes land. Must
be caught by INV-19 (an IO ack counts only pages whose bytes have landed): by the storage
driver's byte model the moment the ack is visible, and by the storage lockstep (the IO leaves
its ``put`` while the oracle's IO is still parked at ``land``). Only a world with page points
(``storage_page_points``) opens the window: without them the put and the writes after it run
in one grant.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO, Transfer
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.operations import PrefetchAck
from hicache_ref.storage.pages import get_page_head

NAME = "io_acks_before_page_write"
INVARIANTS = ("INV-19",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#8901 (window)"


class EarlyAckIO(PrefetchIO):
    def transfer_batch(self, transfer: Transfer) -> bool:
        tier = self.tier
        operation = transfer.operation
        page = tier.page_size
        start = transfer.next_page
        batch = operation.hash_value[start : start + tier.storage_batch_size]
        if transfer.all_success and operation.is_terminated():
            transfer.all_success = False
        landed: list[tuple[int, torch.Tensor]] = []
        if transfer.all_success and batch:
            backend = tier.require_backend("a prefetch transfer")
            targets = [tier.mem_pool_host.get_dummy_flat_data_page() for _ in batch]
            try:
                pages = list(backend.batch_get(batch, targets))
            except Exception:
                pages = []
            for i in range(len(batch)):
                data = pages[i] if i < len(pages) else None
                if data is None or operation.is_terminated():
                    break
                landed.append((i, data))
            if len(landed) != len(batch):
                transfer.all_success = False
            if transfer.prefix_keys is not None:
                transfer.prefix_keys = (*transfer.prefix_keys, *batch)
            transfer.completed_pages += len(landed)
        transfer.next_page += len(batch)
        tier.queues.prefetch_sync_queue.put(
            PrefetchAck(
                rid=operation.request_id,
                operation=operation,
                completed_tokens=transfer.completed_pages * page,
            )
        )
        assert operation.host_indices is not None
        bounce = operation.host_indices[start * page : (start + len(batch)) * page]
        for i, flat in landed:  # MUTATION: the bytes land after the ack that counts them
            tier.mem_pool_host.set_from_flat_data_page(get_page_head(bounce, i, page), flat)
        return transfer.next_page >= len(operation.hash_value)


class Tier(StorageTier):
    prefetch_io_class = EarlyAckIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(
            storage_ranks=1,
            storage_points=True,
            storage_page_points=True,
            storage_batch_pages=1,
        ),
    )
