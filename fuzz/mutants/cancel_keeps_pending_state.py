"""Mutant: ``cancel_layer_write_state`` drains the write stream but leaves the state pending.

Re-creates bug class 12 (stale pending layer-write state after a rollback; the seed's
``cancel_layer_write_state`` docstring): later layer hooks keep copying into host slots the
rollback freed, and an ack is appended for a node the tree no longer backs up. Must be caught
by INV-15 (after a cancel no later hook copies into the node's slots and no ack is appended):
the rollback's ``evict_cp_host`` finds the node's slots still held by a pending write.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "cancel_keeps_pending_state"
INVARIANTS = ("INV-15",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 12 (seed cancel_layer_write_state rollback)"


class Controller(HiCacheController):
    def cancel_layer_write_state(self, node_id: int) -> bool:
        if node_id not in self.pending_layer_writes:
            return False
        self.write_stream.synchronize()
        return True  # MUTATION: the state stays in pending_layer_writes


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
