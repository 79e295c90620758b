"""Mutant: ``reserve_write_cp`` records the logical length as ``padded_len``.

Re-creates a CP metadata record that breaks INV-13 (``padded_len`` must be the logical length
rounded up to a page) on the path the validators do not cover: records built on the device are
never value-checked on the hot path, which this mutant models by copying the record without
validation. ``load_cp`` then rebuilds the node from a padded length that disagrees with its
page owners (bug class 3: owner replay on a wrong allocation length; partial pages, #35401).
Caught at the write: the tree hands every CP reservation's record to the INV-13 checker, which
finds ``padded_len`` below a page multiple. Without that check it would be caught at the reload
(``load``/``reload`` rule -> ``load_cp``): the allocator's ``alloc_pages_with_owners`` returns
whole pages, which differ from the recorded padded length, and ``load_cp`` refuses with INV-03.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.invariants.models import HiCacheWriteReservation

NAME = "metadata_without_padding"
INVARIANTS = ("INV-13", "INV-03")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 3 (padded_len / page_owners disagree); sglang#35401 (partial pages)"


class Controller(HiCacheController):
    def reserve_write_cp(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any:
        result = super().reserve_write_cp(device_indices, priority, node_id)
        if not isinstance(result, HiCacheWriteReservation):
            return result
        meta = result.metadata
        # MUTATION: the unpadded length is recorded (model_copy skips the INV-13 validator)
        bad = meta.model_copy(update={"padded_len": meta.logical_len})
        return result.model_copy(update={"metadata": bad})


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
