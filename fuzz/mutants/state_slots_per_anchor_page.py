"""Mutant: a Mamba state pool's device slots are allocated a page of the anchor's size per node.

The bug the per-pool geometry guards against: a state pool counted as a side pool whose rows
are per token at the anchor's page size. The reference's ``load_with_side`` takes the node's
state slots from the state pool's own allocator, but this mutant asks it for a whole anchor
page of them (``page_size`` slots) instead of the one slot the node's host state holds, as
upstream's ``_resolve_device_transfers`` would with the KV's length (the planted 0.5.23 bug
``mamba_device_slots_per_kv_token``, ``tests/harness/sglang_bugs.py``).

Caught by INV-40: the tree counts the state slots every load of a Mamba world returns against
the harness's geometry (``TreeDriver.check_state_slots``: one per node). The world is focused
on Mamba state pools with pages of two tokens or more (``state_pool_focus``).
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.side_pool import SidePool
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.side_pools import state_pool_focus

NAME = "state_slots_per_anchor_page"
INVARIANTS = ("INV-40",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "issue 27 (0.5.23 HostPoolGroup Mamba pool); planted bug mamba_device_slots_per_kv_token"


class Controller(HiCacheController):
    def _alloc_side_device(self, side: SidePool, tokens: int) -> torch.Tensor | None:
        if side.is_state_pool:
            tokens *= self.page_size  # MUTATION: a page of the anchor's size per state
        return side.allocator.alloc(tokens)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=state_pool_focus())
