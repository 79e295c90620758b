"""Mutant: a (non-CP) backup copies the target KV but never issues the draft D2H.

Re-creates sglang#16964 -> #17338 and #21125 (accept length drops after a HiCache hit: only the
target KV was offloaded, the draft EAGLE/MTP KV at the reused slots was stale), through the
seed's two draft flags that could disagree: the draft op is queued and then dropped when the
write is issued. The bug breaks INV-06 (every copy, target and draft, holds the oracle's bytes);
what catches it is ``TreeDriver.writing_check``, which reads the draft host rows when the write
ack drains and finds them untouched (INV-09), or the quiescence byte check (INV-06).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "draft_not_backed_up"
INVARIANTS = ("INV-09", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#16964 -> #17338, #21125 (draft KV not offloaded); seed has_draft flags"


class Controller(HiCacheController):
    def start_writing(self) -> None:
        self.draft_write_queue.clear()  # MUTATION: the draft D2H is never issued
        super().start_writing()


def implementation() -> MutantImplementation:
    # CP backups go through the per-layer path; this bug lives on the all-layer path
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
