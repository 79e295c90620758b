"""Mutant: ``reserve_write_cp`` accepts a node that has a pending per-layer write.

Re-creates specs/upstream_findings.md F5 (the seed's gate scans only ``ack_write_queue``, so a
node whose per-layer write is still pending gets a second reservation) and bug class 1 (two
acks for one radix registration) (INV-02).

Needs guards: the tree driver backs up only nodes with no backup (``backup == "none"``), as
SGLang's radix cache locks a node while its write is in flight, so only the
``probe_misuse(kind="rewrite")`` rule (``TreeDriver.probe``) asks for a second reservation; the
mutant accepts and the probe raises INV-02. With the ``guards`` capability off the probes are
disabled and nothing sees it.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.config import HarnessConfig

NAME = "reserve_ignores_pending_layer_write"
INVARIANTS = ("INV-02",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = True
BUG = "F5 (seed gate scans only ack_write_queue); bug class 1"


class Controller(HiCacheController):
    def reserve_write_cp(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any:
        pending, self.pending_layer_writes = self.pending_layer_writes, {}
        try:  # MUTATION: the pending per-layer states are not consulted
            return super().reserve_write_cp(device_indices, priority, node_id)
        finally:
            self.pending_layer_writes = pending


def _focus(config: HarnessConfig) -> HarnessConfig:
    # reserve_write_cp exists only on the CP path: draw CP worlds only
    return config.model_copy(update={"cp_size": max(1, config.cp_size), "pool_kind": "nsa"})


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=_focus)
