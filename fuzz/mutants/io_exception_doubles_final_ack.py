"""Mutant: a backend exception inside the IO loop sends the final ack from its handler too.

Re-creates the class of sglang#9971 / #36882 (an exception inside the loop body decides the
acks): the handler of a failed read "finishes" the prefetch at once, and the ``finally`` after
the last batch finishes it again, so the tree drains two final acks (and may release the bounce
tail while the IO still owns it). Must be caught by INV-25 (exactly one final ack per prefetch,
whatever raised where); schedule points draw the exception per call. With two ranks the extra
final ack of the rank that raised shifts its sync thread's reductions against its peer's: INV-21
or INV-20 fires first.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.prefetch_io import PrefetchIO
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.storage_config import storage_focus
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchOperation

NAME = "io_exception_doubles_final_ack"
INVARIANTS = ("INV-25", "INV-23", "INV-19", "INV-21", "INV-20")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "sglang#9971, #36882 (class)"


class HastyIO(PrefetchIO):
    def page_get_or_log(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo,
    ) -> int:
        try:
            return self.page_get(operation, hash_values, host_indices, extra_info)
        except InvariantViolation:
            raise
        except Exception:
            self.finish(operation)  # MUTATION: a final ack here, and again after the last batch
            return 0


class Tier(StorageTier):
    prefetch_io_class = HastyIO


class Controller(HiCacheController):
    storage_tier_class = Tier


def implementation() -> MutantImplementation:
    return MutantImplementation(
        Controller,
        NAME,
        capabilities=CAPABILITIES - {"cp"},
        refine_config=storage_focus(storage_ranks=2, storage_points=True, storage_batch_pages=1),
    )
