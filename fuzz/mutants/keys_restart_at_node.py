"""Mutant: ``write_storage`` without keys chains them from the node's first page, not its parent.

Re-creates sglang#35269: nodes created before a runtime attach had no hash value, so their keys
restarted the chain at the node and two prompts that end alike shared a key (wrong-KV hits).
Must be caught by INV-27 (a page key stands for exactly one whole-page prefix from the root):
chains of the same tokens under different parents get the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.hashing import Token

NAME = "keys_restart_at_node"
INVARIANTS = ("INV-27",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#35269"


class Tier(StorageTier):
    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> int:
        if hash_value is None:  # MUTATION: the parent's last key is ignored
            hash_value = self.compute_page_keys(token_ids, None)
        return super().write_storage(host_indices, token_ids, hash_value, prefix_keys)


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=1),
    )
