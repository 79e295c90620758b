"""Mutant: submitting target layer i also marks draft layer i as submitted.

Re-creates bug class 5 (draft layers incomplete when the write ack is appended) in the form of
the #16964 family (only the target KV offloaded, the draft KV left stale; #17338, #21125,
#30393, #31600): the per-layer write state counts a draft layer as copied when the target
layer with the same index is, so the draft D2H of that layer is never issued, yet every layer
looks submitted and the ack is appended. After a reload the draft pool holds stale KV. Must be
caught by INV-04 (every draft layer submitted before the ack); the harness sees the stale draft
host rows when the ack drains (INV-09) or at quiescence (INV-06).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_layer_counted_with_target"
INVARIANT = "INV-04"
BUG = "bug class 5; sglang#16964 -> #17338, #21125 (draft KV not offloaded with the target)"


class Controller(HiCacheController):
    def _submit_write_cp_layer_states(
        self, states: list[Any], layer_id: int, **kwargs: bool
    ) -> None:
        if kwargs.get("submit_target", True) and layer_id < min(
            self.layer_num, self.draft_layer_num
        ):
            for state in states:
                if state.has_draft and layer_id not in state.completed_target_layers:
                    # MUTATION: the draft layer is counted with the target, never copied
                    state.completed_draft_layers.add(layer_id)
        super()._submit_write_cp_layer_states(states, layer_id, **kwargs)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
