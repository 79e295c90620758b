"""Mutant: ``move_indices`` sorts the host indices but leaves the device indices in op order.

Re-creates bug class 17 (host/device index permutation mismatch): the ``direct`` backend with a
``layer_first`` host layout sorts host indices so contiguous runs merge, and must permute the
device indices with the same order. Without the permutation, token i's KV lands in the host
slot of another token whenever the allocator handed out host pages out of order (or several
ops were merged). The bug breaks INV-06 (byte equality); what catches it is
``TreeDriver.writing_check``, which reads the host copy when the write ack drains and finds
swapped rows (INV-09), the quiescence byte check (INV-06), or, when a reload's H2D puts the
rows back permuted, the forward read of the loading node right after ``start_loading``
(INV-11: the read finds another position's row).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import CacheOperation
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "move_indices_unpermuted_device"
INVARIANTS = ("INV-09", "INV-06", "INV-11")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 17 (move_indices sorts host indices with a permutation the device side misses)"


class Controller(HiCacheController):
    def move_indices(
        self, op: CacheOperation, mem_pool_host: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        host_indices, device_indices = super().move_indices(op, mem_pool_host)
        pool = mem_pool_host or self.mem_pool_host
        if self.io_backend == "direct" and pool.layout == "layer_first":
            return host_indices, op.device_indices.cpu()  # MUTATION: device order not permuted
        return host_indices, device_indices


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
