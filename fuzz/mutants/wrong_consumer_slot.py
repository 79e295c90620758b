"""Mutant: ``start_loading`` returns the slot before the one it recorded the load into.

Re-creates bug class 8 (consumer index mismatch): the scheduler sets the batch's consumer slot
to the id ``start_loading`` returned, and ``get_key_buffer(i)`` waits on layer i of that slot;
a slot of another (finished or never-used) batch makes the forward read layers whose H2D has
not landed (the per-layer gate of #7267/#7280 defeated). Must be caught by INV-11 (a read of
layer i happens after layer i of its batch's producer slot landed).
Caught by a ``forward_read`` of the loading batch: ``TreeDriver.forward_read`` waits on the
returned slot and finds rows that have not landed (INV-11).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "wrong_consumer_slot"
INVARIANTS = ("INV-11", "INV-10")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 8 (set_consumer / wait_until on another batch's slot); sglang#7267, #7280"


class Controller(HiCacheController):
    def start_loading(self) -> int:
        producer_id = super().start_loading()
        if producer_id < 0:
            return producer_id
        # MUTATION: the id handed to the scheduler is off by one slot
        return (producer_id - 1) % self.layer_done_counter.num_counters


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
