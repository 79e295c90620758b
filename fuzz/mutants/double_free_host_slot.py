"""Mutant: host slots freed by ``evict_host`` are released a second time at the next write.

Re-creates sglang#13483 -> #13501 (the same host range released twice, once by the caller and
again later by the I/O thread) on an 0.5.10-style host pool, whose ``free`` has no duplicate
check (bug class 14; #29310 added the ``slot_used`` assert): the late release runs after the
next write allocated its slots, and frees the pages of the evicted node that were handed out
again (a page still free is skipped, as 0.5.10 would silently accept it). The new owner's pages
go back to the free list while it holds them. Must be caught by INV-05 (no page is both free
and owned by a node).
Caught by the session's slot-conservation check after the ``write`` whose late release
freed the new owner's pages (``registry.check_inv_05_slot_conservation``, INV-05).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "double_free_host_slot"
INVARIANTS = ("INV-05",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#13483 -> #13501 (host range released twice); bug class 14"


class Controller(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.late_release: list[torch.Tensor] = []

    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        freed = super().evict_host(host_indices, backup_only)
        self.late_release.append(host_indices.clone())
        return freed

    def start_writing(self) -> None:
        page = self.page_size
        late, self.late_release = self.late_release, []
        for slots in late:
            held = [
                slots[k : k + page]
                for k in range(0, len(slots), page)
                if not self.mem_pool_host.is_page_free(int(slots[k]) // page)
            ]
            if held:
                self.mem_pool_host.free(torch.cat(held))  # MUTATION: released a second time
        super().start_writing()


def implementation() -> MutantImplementation:
    # CP nodes are evicted through evict_cp_host; this bug lives on evict_host
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
