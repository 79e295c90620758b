"""Mutant: the all-layer D2H does not wait on the fence from the forward stream.

Re-creates bug class 11 on the all-layer write path (sglang#38463: a D2H forked from the
schedule stream with no ordering against the KV it copies; vLLM#45704: a store launched with
no event from the compute stream). ``start_writing`` records the fence on the current stream
but the write stream never waits on it, so the D2H can copy a layer before the forward stream
stored it and the host copy holds stale bytes. The rule it breaks is INV-12 (store before
backup); the machine does not inspect stream order, so what catches it is
``TreeDriver.writing_check`` reading the host copy when the write ack drains (INV-09), or the
quiescence byte check (INV-06).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.adapters.unfenced import UnfencedDevice

NAME = "skip_write_fence"
INVARIANTS = ("INV-09", "INV-06", "INV-12")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 11; sglang#38463, vLLM#45704 (D2H not ordered after the KV store)"


class Controller(HiCacheController):
    def start_writing(self) -> None:
        device_module = self.device_module
        self.device_module = UnfencedDevice(device_module)  # MUTATION: its waits do nothing
        try:
            super().start_writing()
        finally:
            self.device_module = device_module


def implementation() -> MutantImplementation:
    # CP backups go through the per-layer path; this bug lives on the all-layer path
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
