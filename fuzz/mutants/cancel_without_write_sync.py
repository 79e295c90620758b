"""Mutant: ``cancel_layer_write_state`` drops the state without draining the write stream.

Re-creates bug classes 4 and 12 (the seed's rollback must ``write_stream.synchronize()`` before
the caller frees the slots): per-layer copies already issued for the cancelled node may still
write its host slots after the rollback freed them (INV-07, INV-15).

What catches it: the lockstep oracle (``harness/lockstep/oracle.py``), fed what the device executed,
sees the rollback free host slots that a queued D2H still writes, at the ``cancel`` step itself
(INV-07). The ordinary checks alone do not: every later user of those slots is ordered after
the stale copies on the FIFO write stream, so only a CPU-side reader sees them early, which is
what ``scribble_free_host`` does in ``tests/harness/test_concurrency_rules.py``.

It draws no storage world: a cancel needs a CP world, which a storage world never is, and a
storage step turns the lockstep oracle off, so such cases only dilute the search (with the
``clear_storage`` rule the unfocused seed-0 campaign took 57-70 s instead of 8 s to catch it)."""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "cancel_without_write_sync"
INVARIANTS = ("INV-07", "INV-15")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug classes 4 and 12 (seed cancel_layer_write_state must synchronize the write stream)"


class Controller(HiCacheController):
    def cancel_layer_write_state(self, node_id: int) -> bool:
        return self.pending_layer_writes.pop(node_id, None) is not None  # MUTATION: no sync


def implementation() -> MutantImplementation:
    storage = {c for c in CAPABILITIES if c.startswith("storage")}
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - storage)
