"""Mutant: a write ack's finish event is recorded on the current (forward) stream.

Re-creates bug class 9 (an ack drained before its transfer finished): the seed records the
completed acks of zero-owned ranks on the current stream, which is harmless only when nothing
was copied; here every write ack is recorded there, so the tree drains it (and unlocks the node,
which may then be evicted from device) while the D2H on the write stream is still queued
(evictions racing the backup, sglang#24585, #27108). Must be caught by INV-09 (a drained ack's
transfer has landed); ``TreeDriver.writing_check`` reads the host copy when the ack drains.
With guards on, a ``probe_misuse(kind="evict_device")`` probe may see it first: the controller
takes the early-finished ack for a landed copy and accepts the eviction (INV-08), or a
``probe_misuse(kind="evict_host")`` probe sees it accept freeing the host slots the D2H still
writes (INV-07).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import HiCacheAck
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "write_ack_on_current_stream"
INVARIANTS = ("INV-09", "INV-08", "INV-07")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 9 (seed completed acks on the current stream); sglang#24585, #27108"


class Controller(HiCacheController):
    def _append_write_ack(self, ack: HiCacheAck) -> None:
        finish_event = self.device_module.Event()
        finish_event.record()  # MUTATION: on the current stream, not after the D2H
        super()._append_write_ack(HiCacheAck(ack.start_event, finish_event, ack.node_ids))


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
