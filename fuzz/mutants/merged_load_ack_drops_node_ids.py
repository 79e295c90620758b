"""Mutant: the ack of a merged load names only the first node of the merged ops.

Re-creates an ack that covers less than what was submitted (sglang#27072: an ack published only
part of the pending range) with the outcome of #20560 (acks never flushed leave nodes locked
forever): ``start_loading`` merges every queued load into one H2D, but its ack carries only the
first op's node id, so the other nodes stay pinned as loading and are never unlocked. Must be
caught by INV-16 (at quiescence every submitted load was acked exactly once).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import HiCacheAck
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "merged_load_ack_drops_node_ids"
INVARIANT = "INV-16"
BUG = "sglang#27072 (ack covers part of the submission), #20560 (nodes never unlocked)"


class Controller(HiCacheController):
    def _append_load_ack(self, ack: HiCacheAck) -> None:
        # MUTATION: only the first merged op's node id is acked
        super()._append_load_ack(HiCacheAck(ack.start_event, ack.finish_event, ack.node_ids[:1]))


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
