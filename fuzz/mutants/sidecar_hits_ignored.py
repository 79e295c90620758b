"""Mutant: the prefetch IO counts a batch's KV pages without the draft sidecar's read.

Re-creates the class ``_page_transfer_kv_batch``'s clamp guards against (upstream 0.5.19+ takes
the MIN of the KV hits and every KV-derived sidecar's): the sidecar's pages are read, but a page
whose sidecar read failed is counted anyway, so the tree inserts a page whose draft layers hold
whatever the bounce slot held before. Must be caught by INV-37 (progress counts a page only with
its sidecar's bytes); schedule points draw the sidecar's hole per call.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES, STORAGE_SIDECAR_CAPABILITY
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchOperation

NAME = "sidecar_hits_ignored"
INVARIANTS = ("INV-37",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "upstream 0.5.19+ _page_transfer_kv_batch's min over sidecar hits (class)"


class SidecarBlindIO(PrefetchIO):
    def sidecar_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        super().sidecar_get(operation, hash_values, host_indices, extra_info)
        return len(hash_values)  # MUTATION: the KV pages counted, whatever the sidecar read


class Tier(StorageTier):
    prefetch_io_class = SidecarBlindIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=(CAPABILITIES - {"cp"}) | {STORAGE_SIDECAR_CAPABILITY},
        refine_config=storage_focus(
            storage_ranks=2,
            storage_points=True,
            storage_batch_pages=2,
            draft_layer_num=2,
            pool_group="none",
            side_device_pages=0,
        ),
    )
