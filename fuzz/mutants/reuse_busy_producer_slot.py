"""Mutant: ``update_producer`` wraps one slot early and never checks the slot.

Re-creates bug class 7 as it happens upstream under ``python -O`` (the ``assert`` that guards
the slot is gone) with an off-by-one ring: the next load takes the slot of the oldest undrained
one and re-records its per-layer and finish events (INV-10).

No byte is ever wrong (one FIFO load stream orders the re-recorded events after the old load's
copies), so what catches it is ``TreeDriver.start_loading``: it checks that the producer id a
``start_loading``/``reload`` returns is not the slot of a node still loading, and raises INV-10.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "reuse_busy_producer_slot"
INVARIANTS = ("INV-10",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
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
