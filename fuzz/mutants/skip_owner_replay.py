"""Mutant: ``load_cp`` takes any free pages instead of replaying the recorded owner pattern.

Re-creates bug class 3: each CP rank's saved ``owned_positions`` index an allocation with a
different owner pattern, so a rank loads its host bytes into physical slots of pages another
rank owns, and attention reads garbage. Must be caught by INV-03 / INV-06 (bytes).
Caught at the reload (``load``/``reload`` -> ``load_cp``) by ``TreeDriver``'s owner-pattern
check: the fresh pages' owners differ from those recorded at write time (INV-03); INV-06 if
the bytes are read first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "skip_owner_replay"
INVARIANTS = ("INV-03", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 3 (seed load_cp comment); CP owner pattern"


class _PlainAllocator:
    """Forwards everything, but answers alloc_pages_with_owners with a plain alloc."""

    def __init__(self, inner: Any, page_size: int) -> None:
        self._inner = inner
        self._page_size = page_size

    def alloc_pages_with_owners(self, page_owners: Sequence[int]) -> torch.Tensor | None:
        # MUTATION: the owner pattern is ignored
        return self._inner.alloc(len(page_owners) * self._page_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Controller(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mem_pool_device_allocator = _PlainAllocator(  # type: ignore[assignment]
            self.mem_pool_device_allocator, self.page_size
        )

    def _verify_owner_replay(
        self, device_indices: torch.Tensor, page_owners: list[int], layout: Any
    ) -> None:
        return  # MUTATION: the check that would refuse the wrong pattern is gone


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, capabilities=CAPABILITIES - {"storage"})
