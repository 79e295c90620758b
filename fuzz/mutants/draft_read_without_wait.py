"""Mutant: a forward read of a draft layer beyond the target's layer count waits on nothing.

Re-creates specs/upstream_findings.md F3 with bug class 8: in the seed the draft pool waits on
the target's per-layer events, and draft layers ``>= layer_num`` have no event at all, so the
forward reads those draft layers of a loading batch before their H2D landed (the per-layer gate
that #7267/#7280 introduced, missing for the draft tail). Caught by a ``forward_read`` of a
draft tail layer of a loading node: the read lands before the layer and
``TreeDriver.forward_read`` finds untouched rows (INV-11: a read of layer i, target or draft,
waits until layer i of its producer slot landed). The focus draws one target and two draft
layers, so half the draft reads hit the tail.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.config import HarnessConfig

NAME = "draft_read_without_wait"
INVARIANTS = ("INV-11",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 8; F3 (seed: draft layers >= layer_num have no load event); sglang#7267"


class _TargetEventsOnly:
    """The seed's draft counter: draft layer i waits on target layer i's event, if there is one."""

    def __init__(self, counter: LayerDoneCounter, device_module: Any) -> None:
        self._counter = counter
        self._device_module = device_module

    def wait_until(self, threshold: int) -> None:
        if threshold < self._counter.num_layers:
            self._counter.wait_until_on_stream(threshold, self._device_module.current_stream())
        # MUTATION: a draft layer past the target's last layer has no event to wait on


class Controller(HiCacheController):
    def attach_draft_pool(self, draft_mem_pool_device: Any, draft_mem_pool_host: Any) -> None:
        super().attach_draft_pool(draft_mem_pool_device, draft_mem_pool_host)
        if draft_mem_pool_device is not None:
            draft_mem_pool_device.register_layer_transfer_counter(
                _TargetEventsOnly(self.layer_done_counter, self.device_module)
            )


def _focus(config: HarnessConfig) -> HarnessConfig:
    # the bug needs a draft tail (draft layers past the target's last one); with one target
    # layer, half of the draft reads of a loading node hit the tail
    return config.model_copy(update={"layer_num": 1, "draft_layer_num": 2})


def implementation() -> MutantImplementation:
    # the draft counter is registered the same way on the CP path; single-rank worlds are faster
    return MutantImplementation(
        Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"}, refine_config=_focus
    )
