"""Mutant: ``evict_host`` releases a node's host span from a token offset, not a page.

Re-creates the partial-page release of sglang#8901 / #13483 (``host_indices[completed_tokens:]``
with a token count that is not a page multiple) and the partial pages of #35401, #24371: the
span handed to the host pool's ``free`` is not whole pages (INV-01).

Caught at any ``evict_host`` (the plain rule, or a ``probe_misuse`` probe): the host pool
refuses the span with ``PageAlignmentError``, which carries INV-01. With ``page_size=1`` every
span is whole pages, the release just skips the first slot, and the session's slot-conservation
check (INV-05) sees the leak. Not about refusing misuse: with guards off the plain
``evict_host`` rule still reaches it.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "misaligned_host_free"
INVARIANTS = ("INV-01", "INV-05")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#8901, #13483 (release from a token offset); #35401, #24371 (partial pages)"


class Controller(HiCacheController):
    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        # MUTATION: the release starts one token into the node's first page
        return super().evict_host(host_indices[1:], backup_only)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
