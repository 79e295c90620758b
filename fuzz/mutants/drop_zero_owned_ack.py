"""Mutant: a CP rank that owns no page of a node appends no write ack for it.

Re-creates bug class 19 (rank-divergent ack rows): the seed appends a completed ack on a rank
that owns nothing (``submit_write_cp_all_layer``; the per-layer path counts its layers), because
ranks drain MIN(ready) acks and pop node ids by position. Dropping the "empty" ack shifts that
rank's rows, so the ranks unlock different nodes, and the node is never acked on that rank.
Must be caught by INV-14 (identical ack rows across ranks) and INV-16 (acked exactly once).
Caught by the session's step check (``Session.check_step_invariants``: the ranks' ack rows
differ, INV-14) or, when the rows drain first, by the never-acked node at quiescence (INV-16).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "drop_zero_owned_ack"
INVARIANTS = ("INV-14", "INV-16")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 19 (seed zero-owned completed ack); sglang#33442, #20460"


class Controller(HiCacheController):
    def _append_layer_write_ack(self, state: Any) -> None:
        if len(state.reservation.physical_device_indices) == 0:
            # MUTATION: nothing was copied, so the state is retired without an ack
            state.ack_appended = True
            self.pending_layer_writes.pop(state.reservation.node_id, None)
            return
        super()._append_layer_write_ack(state)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
