"""Uncaught mutant: ``evict_host`` releases a node's host span from a token offset, not a page.

Re-creates the partial-page release of sglang#8901 / #13483 (``host_indices[completed_tokens:]``
with a token count that is not a page multiple) and the partial pages of #35401, #24371: the
span handed to the host pool's ``free`` is not whole pages (INV-01).

Why the harness does not count it: the host pool refuses the span with ``PageAlignmentError``
("INV-01: ..."), a ``HiCacheInputError``, so ``ReplayResult.signature()`` is
``"PageAlignmentError"`` and ``tests/harness/test_mutants.py`` requires an ``INV-`` signature.
(With ``page_size=1`` the same mutant leaks a slot and is caught as INV-05, but seed 0 finds a
``page_size>1`` case first.) Fix in the harness: give ``PageAlignmentError`` an
``inv_id = "INV-01"`` (and ``DoubleFreeError``/``ForeignSlotError`` ``"INV-05"``), or let
``signature()`` read a leading ``INV-xx:`` from a ``HiCacheInputError`` message; the pool is
enforcing an invariant against the controller here, not rejecting user input.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "misaligned_host_free"
INVARIANT = "INV-01"
BUG = "sglang#8901, #13483 (release from a token offset); #35401, #24371 (partial pages)"


class Controller(HiCacheController):
    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        # MUTATION: the release starts one token into the node's first page
        return super().evict_host(host_indices[1:], backup_only)


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"cp", "storage"})
