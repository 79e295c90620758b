"""Mutant: the load ack's finish event follows the target's last layer, not the draft tail.

Re-creates bug class 6 exactly as the seed has it (specs/upstream_findings.md F2): the finish
event is recorded after target layer ``layer_num - 1``, but with more draft than target layers
the draft layers ``layer_num..`` are copied after it, so the tree drains the load ack and
unpins the node while the draft tail is still in flight. The rule it breaks is INV-04 (a load
ack's finish follows every target and draft copy); the machine does not inspect event order,
so what catches it is ``TreeDriver.loading_check`` reading the draft tail's device rows when the
load ack drains (INV-09), a draft ``forward_read`` (INV-11), or the quiescence bytes (INV-06).
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerLoadingEvent
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.config import HarnessConfig

NAME = "load_finish_on_target_last_layer"
INVARIANTS = ("INV-09", "INV-11", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 6 (seed start_loading: finish_event = load_events[layer_num - 1]); F2"


class Controller(HiCacheController):
    def _issue_load_layers(
        self,
        producer_event: LayerLoadingEvent,
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        draft_layers = self.draft_layer_num
        for i in range(max(self.layer_num, draft_layers)):
            if i < draft_layers:
                if draft_host is not None and draft_device is not None and len(draft_host):
                    pools = self._require_draft_pools()
                    pools[1].load_to_device_per_layer(
                        pools[0], draft_host, draft_device, i, self.io_backend
                    )
                producer_event.complete_draft(i)
            if i < self.layer_num:
                if host_indices is not None and device_indices is not None and len(host_indices):
                    self.mem_pool_host.load_to_device_per_layer(
                        self.mem_pool_device, host_indices, device_indices, i, self.io_backend
                    )
                producer_event.complete(i)
                if i == self.layer_num - 1:
                    # MUTATION: finish after the target's last layer; the draft tail follows it
                    producer_event.finish_event.record()


def _focus(config: HarnessConfig) -> HarnessConfig:
    # the bug needs a draft pool with more layers than the target
    return config.model_copy(update={"draft_layer_num": config.layer_num + 1})


def implementation() -> MutantImplementation:
    # the issue order is the same on the CP path; single-rank worlds find it faster
    return MutantImplementation(
        Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"}, refine_config=_focus
    )
