"""Mutant: a CP rank that owns no page of a loaded node queues no load op for it.

Re-creates bug class 19 (rank-divergent ack rows): the seed's ``load_cp`` keeps a zero-length
op carrying the node id on a rank that owns nothing, so ``start_loading`` merges the same node
ids, takes the same producer slot and appends the same load ack on every rank. Without it the
zero-owned rank's ``start_loading`` returns -1 and appends no ack, so ranks draining MIN(ready)
acks pop different node ids (rank disagreement as in sglang#33442, #20460). Must be caught by
INV-14.
Caught at the ``start_loading`` step: ``TreeDriver.start_loading`` finds the ranks took
different producer slots (the zero-owned rank returned -1; INV-14).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "zero_owned_rank_skips_load_op"
INVARIANTS = ("INV-14",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 19 (seed load_cp zero-owned op); sglang#33442, #20460"


class Controller(HiCacheController):
    def _queue_cp_load(
        self,
        metas: list[Any],
        device_indices: torch.Tensor,
        page_owners: list[int],
        node_id: int,
        layout: Any,
    ) -> torch.Tensor:
        visible = super()._queue_cp_load(metas, device_indices, page_owners, node_id, layout)
        if all(meta.owned_positions.numel() == 0 for meta in metas):
            self.load_queue.pop()  # MUTATION: nothing to copy, so no op (and no ack) at all
        return visible


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
