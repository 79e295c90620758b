"""Uncaught mutant: ``update_producer`` wraps one slot early and never checks the slot.

Re-creates bug class 7 as it happens upstream under ``python -O`` (the ``assert`` that guards
the slot is gone) with an off-by-one ring: the next load takes the slot of the oldest undrained
one and re-records its per-layer and finish events (INV-10).

Why the harness does not catch it: with one FIFO load stream the re-recorded events sit after
the old load's copies on the same stream, so a consumer of the old batch only over-waits and no
byte is ever wrong; the old ack's shared finish event completes later, not earlier. The
session's INV-10 check counts undrained load acks, which the tree itself keeps below
``num_counters``, and ``start_loading``'s own guard counts acks too, so nothing looks at which
slot was handed out. Fix in the harness: in ``TreeDriver.start_loading`` check that the returned
producer id is not the ``producer_id`` of a node still loading (``check_producer_slot_ready``).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "reuse_busy_producer_slot"
INVARIANT = "INV-10"
BUG = "bug class 7 (update_producer assert gone under python -O)"


class _UncheckedShortRing(LayerDoneCounter):
    def update_producer(self) -> int:
        # MUTATION: wraps one slot early, and nothing checks the slot's finish event
        self.producer_index = (self.producer_index + 1) % (self.num_counters - 1)
        return self.producer_index


class Controller(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_done_counter.__class__ = _UncheckedShortRing


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
