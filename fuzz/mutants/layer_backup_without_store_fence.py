"""Mutant: a per-layer CP D2H does not wait on the layer event recorded after the KV store.

Re-creates bug class 11 on the CP per-layer write-back (the seed's "store/copy ordering race"
comment; vLLM#45704, vLLM#31341: a DMA launched without an event from the compute stream).
``_submit_write_cp_layer_states`` records the layer event on the forward stream but the write
stream never waits on it; only the reservation's start event still orders the copy, and for an
early reservation (made before the forward stored any layer) that is too early. The host copy
of the layer then holds pre-store bytes.

The rule it breaks is INV-12 (store before backup); the machine has no check of the stream
order itself, so what catches it is the byte oracle: ``TreeDriver.writing_check`` reads the host
copy when the write ack drains and finds pre-store bytes (INV-09), or the quiescence byte check
(INV-06).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.adapters.unfenced import UnfencedDevice

NAME = "layer_backup_without_store_fence"
INVARIANTS = ("INV-09", "INV-06", "INV-12")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 11 (seed store/copy ordering race); vLLM#45704, vLLM#31341"


class Controller(HiCacheController):
    def _submit_write_cp_layer_states(
        self, states: list[Any], layer_id: int, **kwargs: bool
    ) -> None:
        device_module = self.device_module
        self.device_module = UnfencedDevice(device_module)  # MUTATION: its waits do nothing
        try:
            super()._submit_write_cp_layer_states(states, layer_id, **kwargs)
        finally:
            self.device_module = device_module


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
