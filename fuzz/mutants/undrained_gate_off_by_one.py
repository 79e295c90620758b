"""Mutant: the undrained-write-ack gate's fast path compares with ``>=`` instead of ``>``.

Re-creates bug class 2 (the duplicate-ack gate gives false negatives): the node with the
highest queued id takes the fast path and is reported as having no undrained write ack while
its ack is still in ``ack_write_queue``, so ``reserve_write_cp`` would accept a second backup
of it (two acks for one radix registration, bug class 1). Must be caught by INV-02 (the gate
answers exactly what a scan of the queue answers).
Caught by the session's step check after the ``write`` (``Session.check_step_invariants``:
``node_has_undrained_write_ack`` disagrees with a scan of ``ack_write_queue``, INV-02).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "undrained_gate_off_by_one"
INVARIANTS = ("INV-02",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 2 (seed node_has_undrained_write_ack / _max_write_ack_node_id fast path)"


class Controller(HiCacheController):
    def node_has_undrained_write_ack(self, node_id: int) -> bool:
        if node_id >= self._max_write_ack_node_id:  # MUTATION: was ``>``
            return False
        return self._scan_write_acks(node_id)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
