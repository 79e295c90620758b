"""Mutant: the hit query reduces the hit count over ranks once per batch, inside its loop.

Re-creates sglang#30760 -> #33029: a collective inside a loop whose trip count depends on
rank-local state (here each rank's own hits; upstream, rank-local ``available_size()``) hangs
tensor parallelism when one rank's loop ends earlier. Must be caught by INV-20 (every rank issues
the same collectives in the same order): in a lockstep step the rank group sees one rank finish
while another still waits on a collective. The focus draws two ranks, one-page batches and
background faults, so the ranks' hit runs differ.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.collectives import PREFETCH_HITS, ReduceOp
from hicache_ref.controller.storage.hit_query import HitQuery
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorage

NAME = "hit_sync_per_batch"
INVARIANTS = ("INV-20",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#30760 -> #33029"


class PerBatchHitQuery(HitQuery):
    def query_batch_exists(
        self, backend: HiCacheStorage, keys: list[str], prefix_keys: tuple[str, ...] | None
    ) -> int:
        hits = super().query_batch_exists(backend, keys, prefix_keys)
        agreed = torch.tensor(hits, dtype=torch.int64)
        # MUTATION: one reduction per batch; a rank whose run ended issues fewer of them
        self.tier.collectives.all_reduce(agreed, op=ReduceOp.MIN, group=PREFETCH_HITS)
        return int(agreed.item())


class Tier(StorageTier):
    hit_query_class = PerBatchHitQuery


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_faults=True, storage_batch_pages=1),
    )
