"""Mutant: submitting target layer i also marks draft layer i as submitted.

Re-creates bug class 5 (draft layers incomplete when the write ack is appended) in the form of
the #16964 family (only the target KV offloaded, the draft KV left stale; #17338, #21125,
#30393, #31600): the per-layer write state counts a draft layer as copied when the target
layer with the same index is, so the draft D2H of that layer is never issued, yet every layer
looks submitted and the ack is appended. After a reload the draft pool holds stale KV.

The rule it breaks is INV-04 (every draft layer submitted before the ack), but the mutant
defeats the controller's own INV-04 check (``_append_layer_write_ack`` sees the layer marked
done) and the machine has no independent one, so what catches it is the byte oracle:
``TreeDriver.writing_check`` reads the draft host copy when the write ack drains (``drain_acks``
or quiescence) and finds an untouched row (INV-09: a drained ack covers bytes that never
landed); INV-06 if a later step drains it and the quiescence byte check runs first. In a CP
world with per-layer writes, a cancel right after the first layer is caught by the lockstep
oracle first (INV-07): the mutant's write state no longer matches the copies the device ran,
so the cancel frees the node's draft host pages while the oracle still has a copy queued on
them (a three-step trace; the reference passes it).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_layer_counted_with_target"
INVARIANTS = ("INV-09", "INV-06", "INV-07")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
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
