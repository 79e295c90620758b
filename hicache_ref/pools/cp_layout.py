"""Context-parallel shared-KV layout: which rank owns a logical page, and where it lives there.

Under CP the allocator hands out *logical* token locations; logical page ``p`` is owned by rank
``p % cp_size`` (round robin) and stored on that rank at physical page ``p // cp_size``. Each rank's
device KV pool therefore holds only ``ceil(logical_pages / cp_size)`` pages. The functions are
vectorised torch versions of ``page_math.compute_page_owner`` / ``compute_physical_loc`` and must
agree with them exactly (tests compare them); they run on the tensors' own device without syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools.page_math import compute_physical_num_pages


@dataclass(frozen=True)
class CpSharedKVLayout:
    """Round-robin page ownership for ``cp_size`` ranks, seen from ``cp_rank``."""

    cp_size: int
    cp_rank: int
    page_size: int

    def __post_init__(self) -> None:
        # Verify the group is non-empty, the rank is in it, and pages are non-empty
        if self.cp_size < 1:
            raise HiCacheInputError(f"cp_size must be >= 1 (1 means no CP), got {self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise HiCacheInputError(
                f"cp_rank must be in [0, cp_size) = [0, {self.cp_size}), got {self.cp_rank}"
            )
        if self.page_size < 1:
            raise HiCacheInputError(f"page_size must be >= 1, got {self.page_size}")

    def owner_for_logical_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """The owner rank of each logical page (``pages % cp_size``), same dtype and device."""
        return torch.remainder(pages, self.cp_size)

    def owned_by_this_rank(self, locs: torch.Tensor) -> torch.Tensor:
        """A bool mask: which logical locs lie on pages owned by ``cp_rank``."""
        pages = torch.div(locs, self.page_size, rounding_mode="floor")
        return torch.remainder(pages, self.cp_size) == self.cp_rank

    def logical_locs_to_physical(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical locs on the owner rank: ``(page // cp_size) * page_size + loc % page_size``."""
        pages = torch.div(locs, self.page_size, rounding_mode="floor")
        physical_pages = torch.div(pages, self.cp_size, rounding_mode="floor")
        return physical_pages * self.page_size + torch.remainder(locs, self.page_size)

    def owned_physical_pages_of_list(self, locs: list[int]) -> frozenset[int]:
        """The physical pages of the logical ``locs`` (ints >= 0) this rank owns: the pages of
        ``logical_locs_to_physical(locs[owned_by_this_rank(locs)])``, in Python."""
        page_size, cp_size, rank = self.page_size, self.cp_size, self.cp_rank
        pages = {loc // page_size for loc in locs}
        return frozenset(page // cp_size for page in pages if page % cp_size == rank)

    def plan_owned_of_list(self, padded: list[int]) -> tuple[list[int], list[int], list[int]]:
        """For whole-page logical locs ``padded`` (ints >= 0): the positions this rank owns, their
        physical locs, and each page's owner; ``owned_by_this_rank``, ``logical_locs_to_physical``
        and ``owner_for_logical_pages`` in Python (a CP reservation's few pages)."""
        page_size, cp_size, rank = self.page_size, self.cp_size, self.cp_rank
        positions: list[int] = []
        physical: list[int] = []
        for position, loc in enumerate(padded):
            page = loc // page_size
            if page % cp_size == rank:
                positions.append(position)
                physical.append((page // cp_size) * page_size + loc % page_size)
        owners = [(loc // page_size) % cp_size for loc in padded[::page_size]]
        return positions, physical, owners

    def physical_num_pages(self, logical_num_pages: int) -> int:
        """Pages each rank must hold so that logical pages ``0 .. logical_num_pages-1`` fit."""
        if logical_num_pages < 0:
            raise HiCacheInputError(f"logical_num_pages must be >= 0, got {logical_num_pages}")
        return compute_physical_num_pages(logical_num_pages, self.cp_size)
