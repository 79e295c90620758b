"""Mutant: a CP rank that owns no page of a node counts the node's draft layers as done.

Re-creates specs/upstream_findings.md F4 (the seed decides "has a draft" from the rank's own
draft host indices, which a zero-owned rank does not have) and bug class 19 (rank-divergent
ack rows): the zero-owned rank appends its write ack at the target's last layer hook, while the
owning ranks wait for the draft tail. With more draft than target layers the ranks' ack rows
differ mid-run, so ranks draining MIN(ready) acks pop different node ids and their radix trees
diverge. Must be caught by INV-14 (identical ack rows across ranks; INV-04 on every rank).
Caught by ``TreeDriver``'s ack drain or the session's step check (the ranks' write ack
rows differ, INV-14), or by the zero-owned rank's own controller: its next layer hook finds the
node's early ack undrained and refuses the per-layer write (INV-02).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "zero_owned_rank_skips_draft_layers"
INVARIANTS = ("INV-14", "INV-02")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 19; F4 (seed zero-owned rank skips the draft wait); sglang#33442 family"


class Controller(HiCacheController):
    def _get_or_create_layer_write_state(self, reservation: Any) -> Any:
        state = super()._get_or_create_layer_write_state(reservation)
        if len(reservation.physical_device_indices) == 0 and state.has_draft:
            # MUTATION: nothing to copy here, so the draft layers are counted as done at once
            state.completed_draft_layers.update(range(self.draft_layer_num))
        return state


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
