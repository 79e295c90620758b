"""Mutant: a (non-CP) load queues the target H2D but not the draft H2D.

Re-creates sglang#16964 -> #17338 (draft KV stale after an L2 hit: the target pages were loaded
into the new device slots, the draft pages were not, so the draft model read another request's
KV at those slots; #30393, #31600). The bug breaks INV-06 (every resident copy holds the
oracle's bytes); what catches it is ``TreeDriver.loading_check`` reading the draft device rows
when the load ack drains (INV-09), a ``forward_read`` of a draft layer (INV-11), or the
quiescence byte check (INV-06).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_not_loaded"
INVARIANTS = ("INV-09", "INV-11", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#16964 -> #17338, #30393 (draft KV not loaded with the target)"


class Controller(HiCacheController):
    def load(
        self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any:
        device_indices = super().load(host_indices, priority, node_id)
        if device_indices is not None and self.draft_load_queue:
            self.draft_load_queue.pop()  # MUTATION: the draft op is never queued
        return device_indices


def implementation() -> MutantImplementation:
    # CP loads go through load_cp; this bug lives on the non-CP load path
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
