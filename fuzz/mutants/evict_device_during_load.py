"""Mutant: ``evict_device`` frees pages without checking pending copies.

Re-creates bug class 10 (device pages freed or reused while an H2D writes them or a D2H reads
them; sglang#36738, #38463): ``evict_device`` skips both the pending per-layer write check and
the in-flight tracker (INV-08).

Needs guards: the tree driver, like SGLang's radix cache, pins a loading node until its load
ack drains and offers ``evict_device`` only for a node whose backup ack was drained, so only
the ``probe_misuse(kind="evict_device")`` rule (``TreeDriver.probe``) asks to free a page in
flight; the mutant accepts and the probe raises INV-08. With the ``guards`` capability off the
probes are disabled and nothing sees it. (``fuzz/mutants/skip_load_fence.py`` shows INV-08
through the load fence instead.)
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "evict_device_during_load"
INVARIANTS = ("INV-08",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = True
BUG = "bug class 10; sglang#36738, #38463"


class Controller(HiCacheController):
    def evict_device(self, device_indices: torch.Tensor) -> int:
        self.mem_pool_device_allocator.free(device_indices)  # MUTATION: no in-flight check
        return len(device_indices)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
