"""Uncaught mutant: ``reserve_write_cp`` accepts a node that has a pending per-layer write.

Re-creates specs/upstream_findings.md F5 (the seed's gate scans only ``ack_write_queue``, so a
node whose per-layer write is still pending gets a second reservation) and bug class 1 (two
acks for one radix registration) (INV-02).

Why the harness does not catch it: the tree driver backs up only nodes with no backup
(``backup == "none"``), as SGLang's radix cache locks a node while its write is in flight, so it
never asks for a second reservation; besides, the reference's
``_get_or_create_layer_write_state`` still refuses the second state. Fix in the harness: a rule
that calls ``reserve_write_cp`` for a node whose backup is in flight and expects
``HiCacheWriteFailure(reason="undrained_ack")`` with the pools unchanged (INV-17).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "reserve_ignores_pending_layer_write"
INVARIANT = "INV-02"
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


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
