"""Uncaught mutant: ``cancel_layer_write_state`` drops the state without draining the write stream.

Re-creates bug classes 4 and 12 (the seed's rollback must ``write_stream.synchronize()`` before
the caller frees the slots): per-layer copies already issued for the cancelled node may still
write its host slots after the rollback freed them (INV-15, INV-07).

Why the harness does not catch it: every later user of those slots is ordered after the stale
copies. A new backup into them is queued on the same FIFO write stream, and a load reads them
only after that backup's ack drained, so the stale copy always lands first and is overwritten;
the cancelled copies are not in the in-flight tracker, so no refusal fires either. Only a reader
outside the write stream sees the slots early: the storage tier's CPU-side ``get_data_page``
(backup to L3), which the state machine does not drive. Fix in the harness: storage rules
(write_storage / prefetch) in the machine, or a check after each cancel that the cancelled
node's issued copies have executed (``check_cancel_quiesced``) before the rollback frees.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "cancel_without_write_sync"
INVARIANTS = ("INV-15", "INV-07")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug classes 4 and 12 (seed cancel_layer_write_state must synchronize the write stream)"


class Controller(HiCacheController):
    def cancel_layer_write_state(self, node_id: int) -> bool:
        return self.pending_layer_writes.pop(node_id, None) is not None  # MUTATION: no sync


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
