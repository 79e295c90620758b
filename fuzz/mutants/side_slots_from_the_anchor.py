"""Mutant: an independent side pool's host slots are allocated from the anchor's host pool.

Re-creates the planted 0.5.23 bug of the same name (``tests/harness/sglang_bugs.py``: upstream's
``HostPoolGroup.resolve_host_transfers`` resolving the SWA transfer's slots through the KV
entry's allocator): a backup's side bytes go to slot numbers the side pool never handed out,
so a later side backup gets the same slots and overwrites them, while the anchor's pool loses
slots no anchor node holds.

Caught by INV-36: the tree checks what every write of a side-pool world returns against the
harness's own pools (``TreeDriver.check_group_indices``): the side host slots are not allocated
in the side pool. The world is focused on side pools (``side_pool_focus``); without INV-36 the
slot conservation check (INV-05) sees the anchor pages no node owns.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.side_pool import SidePool
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.side_pools import side_pool_focus

NAME = "side_slots_from_the_anchor"
INVARIANTS = ("INV-36", "INV-05")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "issue 27 (0.5.23 HostPoolGroup side pools); planted bug side_slots_from_the_anchor"


class Controller(HiCacheController):
    def _alloc_side_host(self, side: SidePool, tokens: int) -> torch.Tensor | None:
        return self.mem_pool_host.alloc(tokens)  # MUTATION: the anchor's host pool


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=side_pool_focus())
