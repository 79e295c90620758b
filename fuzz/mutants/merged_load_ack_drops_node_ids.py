"""Mutant: the ack of a merged load names only the first node of the merged ops.

Re-creates an ack that covers less than what was submitted (sglang#27072: an ack published only
part of the pending range) with the outcome of #20560 (acks never flushed leave nodes locked
forever): ``start_loading`` merges every queued load into one H2D, but its ack carries only the
first op's node id, so the other nodes stay pinned as loading and are never unlocked. Caught at
quiescence (``Session.finish``): the loads of the dropped node ids are never acked, and the
drain rounds end with "acks never drained" (INV-16: every submitted load is acked exactly
once). Needs two ``load`` steps before one ``start_loading``; the focus gives the pools room. With
few producer slots a later ``start_loading`` may first hand out the slot the unacked load still
holds (``TreeDriver.start_loading``'s slot check, INV-10); the focus draws 16 slots.
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import HiCacheAck
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.config import HarnessConfig

NAME = "merged_load_ack_drops_node_ids"
INVARIANTS = ("INV-16", "INV-10")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#27072 (ack covers part of the submission), #20560 (nodes never unlocked)"


class Controller(HiCacheController):
    def _append_load_ack(self, ack: HiCacheAck) -> None:
        # MUTATION: only the first merged op's node id is acked
        super()._append_load_ack(HiCacheAck(ack.start_event, ack.finish_event, ack.node_ids[:1]))


def _focus(config: HarnessConfig) -> HarnessConfig:
    # the bug needs two backed-up nodes loaded back in one start_loading: room for both; with
    # 16 producer slots a case rarely cycles back to the slot the unacked load holds (INV-10,
    # whose traces are long) before quiescence sees the missing ack (INV-16)
    return config.model_copy(update={"host_pages": 24, "device_pages": 40, "num_counters": 16})


def implementation() -> MutantImplementation:
    # load_cp merges through the same start_loading; one rank reaches two queued loads faster
    return MutantImplementation(
        Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"}, refine_config=_focus
    )
