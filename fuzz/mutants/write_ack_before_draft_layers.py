"""Mutant: a per-layer write state counts as done once every target layer was submitted.

Re-creates bug class 5 (draft layers incomplete when the write ack is appended; the
#16964 -> #17338, #21125 family of stale draft KV): ``_layer_write_state_done`` forgets the draft
layers, so with more draft than target layers the node's ack is due while draft layer
``layer_num`` was never copied. Must be caught by INV-04: the reference's
``_append_layer_write_ack`` verifies every target and draft layer before appending the ack, and
refuses (``fuzz/mutants/draft_layer_counted_with_target.py`` defeats that check and is caught
by the bytes instead).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "write_ack_before_draft_layers"
INVARIANTS = ("INV-04",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 5 (seed _layer_write_state_done); sglang#16964 -> #17338, #21125"


class Controller(HiCacheController):
    def _layer_write_state_done(self, state: Any) -> bool:
        # MUTATION: the draft layers are not consulted
        return bool(state.completed_target_layers.issuperset(range(self.layer_num)))


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
