"""Mutant: the H2D does not wait on the fence from the forward stream.

Re-creates sglang#36738: under overlap scheduling a finished request's pages are freed while
the already-launched forward work still writes them, and the H2D on the load stream was not
ordered after that work. ``start_loading`` records the producer's start event but the load
stream never waits on it, so a load into reused pages can land before a queued store of the
page's previous owner, which then overwrites the loaded KV.

The rule it breaks is INV-08 (no device page reused while queued forward work uses it); the
machine does not inspect stream order, so what catches it is the byte oracle seeing the loaded
KV overwritten: a queued ``forward_read`` of the page's previous owner (INV-11), the load ack
drain in ``TreeDriver.loading_check`` (INV-09), or the quiescence bytes (INV-06).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.adapters.unfenced import UnfencedEvent
from hicache_ref.harness.world.config import HarnessConfig

NAME = "skip_load_fence"
INVARIANTS = ("INV-11", "INV-09", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#36738 (H2D into reused pages not ordered after queued forward work); bug class 10"


class Controller(HiCacheController):
    def start_loading(self) -> int:
        if self.load_queue or self.draft_load_queue:
            counter = self.layer_done_counter
            slot = counter.events[(counter.producer_index + 1) % counter.num_counters]
            slot.start_event = UnfencedEvent(self.device_module.Event())  # MUTATION: no fence
        return super().start_loading()


def _focus(config: HarnessConfig) -> HarnessConfig:
    # the bug needs a page freed with its store still queued, then reused at once by a load
    return config.model_copy(update={"alloc_policy": "lifo", "settle_records": True})


def implementation() -> MutantImplementation:
    # the fence is the same on the CP path; single-rank worlds find the reuse faster
    return MutantImplementation(
        Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"}, refine_config=_focus
    )
