"""Mutant: the prefetch IO never looks at termination between batches.

Re-creates sglang#16747 / #31296's window: the tree terminated the prefetch (an abort) and
settled its pages, but the IO goes on reading batch after batch into the bounce buffer. Must be
caught by INV-33 (no backend read of a prefetch after its termination returned, one in flight
aside); batches of one page, so a termination lands between batches.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO, Transfer
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchAck

NAME = "io_ignores_termination"
INVARIANTS = ("INV-33",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#16747, #31296"


class BlindIO(PrefetchIO):
    def transfer_batch(self, transfer: Transfer) -> bool:
        """``PrefetchIO.transfer_batch`` without its look at termination before the read."""
        tier = self.tier
        operation = transfer.operation
        page_size = tier.page_size
        batch_hashes = operation.hash_value[
            transfer.next_page : transfer.next_page + tier.storage_batch_size
        ]
        # MUTATION: no `if transfer.all_success and operation.is_terminated()` here
        if transfer.all_success and batch_hashes:
            host_indices = operation.host_indices
            assert host_indices is not None
            start, end = transfer.next_page * page_size, (transfer.next_page + len(batch_hashes))
            extra_info = HiCacheStorageExtraInfo(prefix_keys=transfer.prefix_keys)
            hit_pages = self.page_get_or_log(
                operation, batch_hashes, host_indices[start : end * page_size], extra_info
            )
            if hit_pages != len(batch_hashes):
                transfer.all_success = False
            if transfer.prefix_keys is not None:
                transfer.prefix_keys = (*transfer.prefix_keys, *batch_hashes)
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


class Tier(StorageTier):
    prefetch_io_class = BlindIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=2, storage_points=True, storage_batch_pages=1),
    )
