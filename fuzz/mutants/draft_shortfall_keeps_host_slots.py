"""Mutant: ``reserve_write_cp`` keeps the target host slots when the draft alloc fails.

Re-creates specs/upstream_findings.md F6 and INV-17 (a refused write leaves every pool as it
was): the target host slots allocated before the draft host pool came up short are never given
back, so each refusal leaks them.

Caught since CP configs draw their own draft host pool size (``draft_host_pages``): a
``prefill``/``write`` whose reservation is refused with ``draft_host_capacity`` leaves target
host pages allocated that no node owns. The session's check that a refused step left every
rank's pools as they were raises INV-17; without that check, the slot-conservation check after
the step (``registry.check_inv_05_slot_conservation``) sees the same pages as INV-05.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_shortfall_keeps_host_slots"
INVARIANTS = ("INV-17", "INV-05")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "F6 (seed reserve_write_cp draft shortfall); sglang#27108 (failed backup not rolled back)"


class _FreeNothing:
    """Forwards everything to the host pool, but ``free`` does nothing."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def free(self, indices: torch.Tensor) -> int:
        return 0  # MUTATION: the refusal path gives nothing back

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Controller(HiCacheController):
    def reserve_write_cp(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any:
        host_pool = self.mem_pool_host
        self.mem_pool_host = _FreeNothing(host_pool)  # type: ignore[assignment]
        try:
            return super().reserve_write_cp(device_indices, priority, node_id)
        finally:
            self.mem_pool_host = host_pool


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
