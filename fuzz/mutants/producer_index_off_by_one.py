"""Mutant: ``update_producer`` wraps at ``num_counters - 1``, so the slot ring is one short.

Re-creates bug class 7 (a producer slot reused before its previous load finished): the tree
keeps fewer than ``num_counters`` load acks undrained, which is safe only if the producer walks
all ``num_counters`` slots; an off-by-one modulus walks ``num_counters - 1``, so the next load
takes the slot of the oldest undrained one. Upstream an ``assert`` (gone under ``python -O``)
is all that stands between this and a consumer waiting on re-recorded events. Must be caught by
INV-10 (``update_producer`` never hands out a slot whose finish event is pending).
Caught by ``TreeDriver.start_loading`` (the ``reload``/``start_loading`` rules): the producer
id it returns is the slot of a node still loading (INV-10).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "producer_index_off_by_one"
INVARIANTS = ("INV-10",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 7 (LayerDoneCounter.update_producer slot reuse; 0.5.23 has_free_load_back_slot)"


class _ShortRingCounter(LayerDoneCounter):
    def update_producer(self) -> int:
        if self.producer_index + 1 >= self.num_counters - 1:
            self.producer_index = -1  # MUTATION: wraps one slot early
        return super().update_producer()


class Controller(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_done_counter.__class__ = _ShortRingCounter


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
