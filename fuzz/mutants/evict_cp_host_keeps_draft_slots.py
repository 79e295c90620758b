"""Mutant: ``evict_cp_host`` frees a node's target host slots but not its draft host slots.

Re-creates the seed's two draft flags that could disagree (``has_draft`` vs
``has_draft_hicache``; eviction consulted the one that said "no draft") as a leak of the draft
host pool: every evicted or rolled-back CP node keeps its draft host pages, the free list
shrinks until draft reservations fail (slot leaks as in #16747/#9927; draft host pools
outside the accounting, #30581). Must be caught by INV-05 (every draft host page is free or
owned by exactly one node).
Caught by the session's slot-conservation check after the ``evict_host``: draft host pages
allocated but owned by no node (INV-05); or, when a reservation refused on one rank is rolled
back on the others with ``evict_cp_host``, by the refusal check: the refused write left draft
host pages allocated, so it changed the pools (INV-17).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "evict_cp_host_keeps_draft_slots"
INVARIANTS = ("INV-05", "INV-17")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "seed has_draft / has_draft_hicache disagreement; slot leaks sglang#16747, #9927, #30581"


class Controller(HiCacheController):
    def evict_cp_host(self, metadata: Any, backup_only: bool = True) -> int:
        draft_host_pool = self.draft_mem_pool_host
        self.draft_mem_pool_host = None  # MUTATION: eviction sees no draft pool
        try:
            return super().evict_cp_host(metadata, backup_only)
        finally:
            self.draft_mem_pool_host = draft_host_pool


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
