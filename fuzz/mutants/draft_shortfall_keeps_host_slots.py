"""Uncaught mutant: ``reserve_write_cp`` keeps the target host slots when the draft alloc fails.

Re-creates specs/upstream_findings.md F6 and INV-17 (a refused write leaves every pool as it
was): the target host slots allocated before the draft host pool came up short are never given
back, so each refusal leaks them.

Why the harness does not catch it: the harness builds the draft host pool with the target's
``host_pages``, and every reservation asks both pools for the same number of slots and every
eviction frees both, so the draft pool is never short when the target pool was not; the
``draft_host_capacity`` path never runs. Fix in the harness: draw the CP draft host pool's size
separately (e.g. ``draft_host_pages`` in ``HarnessConfig``, smaller than ``host_pages``); the
session's INV-05 check then sees the leaked target slots.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_shortfall_keeps_host_slots"
INVARIANT = "INV-17"
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
