"""Mutant: host slots are freed as soon as the D2H is issued, before its write ack.

Re-creates bug class 4 / sglang#27444's cousin on the write side: the slots go back to the
free list while the copy still writes them, so the next backup can take them and one of the
two host copies is corrupted. The rule it breaks is INV-07 (no host free while in flight); what
catches it is the session's slot-conservation check right after the ``write`` step
(``registry.check_inv_05_slot_conservation``: pages owned by a node but free, INV-05), before any later
step could reuse the slots.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "free_host_before_write_ack"
INVARIANTS = ("INV-05",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 4; sglang#27444, #13483"


class Controller(HiCacheController):
    def write(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any:
        host = super().write(device_indices, priority, node_id)
        if isinstance(host, torch.Tensor):
            # MUTATION: return the slots to the pool while the D2H is still in flight
            self.mem_pool_host.free(host)
        return host


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, capabilities=_non_cp())


def _non_cp() -> frozenset[str]:
    from hicache_ref.harness.adapters.base import CAPABILITIES

    return CAPABILITIES - {"cp", "storage"}
