"""Mutant: buffer mode's heal keeps the first page the agreed hit query found missing.

Re-creates an off-by-one in the tree's ``_invalidate_absent_from_hit_query`` (SGLang 0.5.19+
buffer mode; the class of ``belief_heal_keeps_the_first_missing_page``, planted on 0.5.23 by
``tests/harness/sglang_bugs.py``): beliefs past the rank-agreed verdict are forgotten from one
page too late, so the page every rank's query found missing stays believed stored. The tree
then skips that page's backup for good and every later hit on the prefix recomputes it. Must
be caught by INV-41 (a belief never outlives a drained query that found the page missing).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.existence_beliefs import StorageExistenceBeliefs
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus

NAME = "heal_keeps_first_missing_page"
INVARIANTS = ("INV-41",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "upstream 0.5.19+ buffer mode _invalidate_absent_from_hit_query: heal off by one (class)"


class Beliefs(StorageExistenceBeliefs):
    def heal_from_verdict(self, chain: Sequence[str], hit_pages: int) -> None:
        pool = self.pool()
        # MUTATION: forgets from the page after the first missing one
        pool.forget_beyond(chain, hit_pages + 1)
        pool.learn(chain[:hit_pages])


class Controller(HiCacheController):
    existence_beliefs_class = Beliefs


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller, NAME, refine_config=storage_focus(storage_buffer_only=True)
    )
