"""Mutant: the prefetch IO reads an SWA window of the request's span, not of the hit served.

Re-creates the class ``_sync_trailing_keys`` guards against (upstream 0.5.19+: "each pool
transfer's keys must be updated to the last N hashes of the actual hit range instead of the
last N hashes of the original target range"): when the hit served is shorter than the span the
prefetch asked (L3 holds a shorter prefix, or the tree cut the hit to its host room), the
window's keys are the span's last pages, so the tree keeps window slots holding the SWA pages
of a prefix it did not fetch, or loses a window every rank's L3 holds. Must be caught by INV-39
(a kept window holds the served hit's trailing pages; a stored window is not lost).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO
from hicache_ref.controller.storage.side_window import read_windows, sync_trailing_keys
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.side_pools import side_window_focus
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pool_transfers import PoolTransfer

NAME = "window_of_the_request_span"
INVARIANTS = ("INV-39",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "upstream 0.5.19+ _sync_trailing_keys: the window of the hit served, not of the span (class)"


class SpanWindowIO(PrefetchIO):
    def read_windows(self, operation: PrefetchOperation, kv_pages: int) -> None:
        span = list(operation.all_hash_values or ())

        def sync(transfers: list[PoolTransfer], hashes: Sequence[str], hit_pages: int) -> None:
            # MUTATION: re-aligned to the request span's last pages, not the served hit's
            sync_trailing_keys(self.tier, transfers, span, len(span))

        read_windows(self.tier, operation, kv_pages, sync)


class Tier(StorageTier):
    prefetch_io_class = SpanWindowIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=side_window_focus())
