"""Mutant: every rank tells its backend it is rank 0 of 1, so the ranks' keys carry no shard.

Re-creates sglang#10969: keys without the TP rank, so ranks overwrote (or first-writer-skipped)
each other's shards in a shared L3. Must be caught by INV-28 (one writer per stored key). The
focus draws two ranks of an MHA pool (an MLA pool's keys are rank-less by design, and only rank
0 writes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageConfig

NAME = "keys_without_rank"
INVARIANTS = ("INV-28",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#10969"


class Tier(StorageTier):
    def generate_storage_config(
        self, model_name: str | None, storage_backend_extra_config: Mapping[str, object] | None
    ) -> HiCacheStorageConfig:
        config = super().generate_storage_config(model_name, storage_backend_extra_config)
        return replace(config, tp_rank=0, tp_size=1)  # MUTATION: the shard is dropped


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(pool_kind="mha"),
    )
