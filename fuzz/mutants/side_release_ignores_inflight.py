"""Mutant: an independent side pool's host slots are released while a copy still uses them.

Re-creates sglang#27444 / #31427 / #26728 (host pages reused while a copy still used them) in a
pool group's side pool: upstream's ``HostPoolGroup.free(..., pool=SWA)`` goes straight to the
SWA host pool's allocator, so a release of a node whose side backup is still queued hands its
slots to the next backup while the D2H still writes them. The reference's ``evict_side_host``
frees without asking the in-flight tracker.

Needs guards: the tree releases a node's host copy only once its backup ack was drained, so only
the ``probe_evict_host`` misuse probe asks, and it asks the side pool's release on its own
before the anchor's (whose refusal would hide this one): the mutant accepts, the probe raises
INV-07. The world is focused on side pools (``side_pool_focus``).
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.side_pools import side_pool_focus

NAME = "side_release_ignores_inflight"
INVARIANTS = ("INV-07",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = True
BUG = "sglang#27444, #31427, #26728 in a HostPoolGroup side pool (issue 27); bug class 4"


class Controller(HiCacheController):
    def _check_side_slots_idle(self, side_host: torch.Tensor) -> None:
        return  # MUTATION: the side pool's slots are never checked against queued copies


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=side_pool_focus())
