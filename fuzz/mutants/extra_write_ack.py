"""Mutant: a write appends a second, already-completed ack for the same node.

Re-creates bug class 1 (two acks for one radix registration: one inc_lock_ref, two
completions), which the seed guards with ``node_has_undrained_write_ack``. Must be caught by
INV-02 (at most one undrained write ack per node).
Caught by the session's step check after the ``write`` (``Session.check_step_invariants``:
node ids that appear twice among the undrained write acks, INV-02).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import HiCacheAck
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "extra_write_ack"
INVARIANTS = ("INV-02",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 1 (protocol notes section 10); seed reserve_write_cp guard"


class Controller(HiCacheController):
    def start_writing(self) -> None:
        node_ids = [n for op in self.write_queue for n in op.node_ids]
        super().start_writing()
        if node_ids:
            event = self.device_module.Event()
            event.record()
            # MUTATION: bypasses _append_write_ack, so nothing refuses the duplicate
            self.ack_write_queue.append(HiCacheAck(event, event, node_ids))


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
