"""Mutant: the load ack's finish event is recorded before the last layer's H2D.

Re-creates bug class 6 (the seed's finish event is the target's last layer event, which a
longer draft tail lands after) in its plainest form: the tree drains the ack and unpins the
node while the last layer is still in flight. Caught by ``TreeDriver.loading_check``, which
reads the device copy when the load ack drains and finds the last layer missing (INV-09: a
drained ack's transfer has landed), or by a ``forward_read`` after the drain (INV-11).
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerLoadingEvent
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "load_ack_before_last_layer"
INVARIANTS = ("INV-09", "INV-11")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 6; sglang#7267 family"


class Controller(HiCacheController):
    def _issue_load_layers(
        self,
        producer_event: LayerLoadingEvent,
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        last = max(self.layer_num, self.draft_layer_num) - 1
        for i in range(last + 1):
            if i == last:
                # MUTATION: finish recorded before the last layer is issued
                producer_event.finish_event.record()
            if i < self.draft_layer_num:
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


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
