"""The device page allocator: which device KV pages are free, and handing them out.

Mirrors SGLang 0.5.10 ``PagedTokenToKVPoolAllocator`` (page 0 reserved for padded tokens, pages
``1 .. size // page_size`` allocatable, ``alloc`` returns token locs ``page * page_size + arange``,
``free`` frees every page an index list touches), with the checks upstream only has in debug mode
made unconditional and all-or-nothing:

- ``alloc`` takes whole pages only (INV-01);
- ``free`` refuses a double free and a foreign page (INV-05) *before* changing anything, so a
  refused free leaves the allocator exactly as it was (INV-17);
- ``alloc_pages_with_owners`` (CP, fork only) replays a recorded page-owner pattern (INV-03).

Under CP ``size`` counts *logical* tokens; each rank's device pool stores only the pages it owns
(see ``CpSharedKVLayout``). Which free page is handed out is the ``alloc_policy`` (``free_pages``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache_ref.errors import (
    DoubleFreeError,
    ForeignSlotError,
    HiCacheInputError,
    InvariantViolation,
    PageAlignmentError,
)
from hicache_ref.pools.cp_layout import CpSharedKVLayout
from hicache_ref.pools.free_pages import PageFreeList
from hicache_ref.pools.page_index import SMALL_INDEX_MAX, check_index_tensor, get_small_cpu_values

if TYPE_CHECKING:
    from hicache_ref.pools.device_pool import KVCache


def pages_to_token_locs(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Token locs ``page * page_size + arange(page_size)`` for each page, flattened (int64, CPU)."""
    if len(pages) * page_size <= SMALL_INDEX_MAX:  # one tensor from ints beats four torch ops
        locs = [page * page_size + offset for page in pages for offset in range(page_size)]
        return torch.tensor(locs, dtype=torch.int64)
    page_tensor = torch.tensor(list(pages), dtype=torch.int64)
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (page_tensor[:, None] * page_size + offsets).reshape(-1)


class PagedTokenToKVPoolAllocator:
    """Hands out device KV pages ``1 .. size // page_size`` (page 0 is the padding page)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: KVCache | None,
        need_sort: bool = False,
        *,
        alloc_policy: str = "fifo",
        seed: int = 0,
        cp_layout: CpSharedKVLayout | None = None,
    ) -> None:
        # Verify page geometry: positive pages, size a page multiple (INV-01)
        if page_size < 1:
            raise HiCacheInputError(f"page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size != 0:
            raise PageAlignmentError(
                f"INV-01: allocator size={size} must be a non-negative multiple of "
                f"page_size={page_size} (size counts tokens)"
            )
        # Verify a CP layout agrees on the page size
        if cp_layout is not None and cp_layout.page_size != page_size:
            raise HiCacheInputError(
                f"cp_layout.page_size={cp_layout.page_size} differs from the allocator's "
                f"page_size={page_size}; build both from the same page size"
            )
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.cp_layout = cp_layout
        self.cp_size = 1 if cp_layout is None else cp_layout.cp_size
        self.num_pages = size // page_size
        self._free = PageFreeList(
            range(1, self.num_pages + 1),
            alloc_policy=alloc_policy,
            seed=seed,
            num_owner_classes=self.cp_size,
        )
        self.alloc_policy = self._free.alloc_policy
        self._release_pages: dict[int, None] = {}

    # ------------------------------------------------------------------ reads
    def get_kvcache(self) -> KVCache:
        """The device KV pool whose pages this allocator hands out."""
        if self._kvcache is None:
            raise HiCacheInputError("this allocator was built without a kvcache (kvcache=None)")
        return self._kvcache

    def available_size(self) -> int:
        """Free tokens (free pages, including those waiting in the release list, times page)."""
        return (self._free.count() + len(self._release_pages)) * self.page_size

    def free_page_ids(self) -> list[int]:
        """Every free page (the release list included), ascending."""
        return sorted(self._free.sorted_pages() + list(self._release_pages))

    def allocated_page_ids(self) -> frozenset[int]:
        """Pages handed out and not freed yet (never page 0); kept by alloc and free."""
        taken = self._free.taken_pages()
        return taken - self._release_pages.keys() if self._release_pages else taken

    def is_page_free(self, page: int) -> bool:
        """Whether ``page`` is free (in the free list or the release list)."""
        return self._free.is_free(page) or page in self._release_pages

    # ------------------------------------------------------------------ alloc
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Token locs of ``need_size // page_size`` pages, or ``None`` when too few are free."""
        need_size = operator.index(need_size)
        # Verify whole pages are asked for (INV-01)
        if need_size < 0 or need_size % self.page_size != 0:
            raise PageAlignmentError(
                f"INV-01: alloc(need_size={need_size}) must ask for a non-negative multiple of "
                f"page_size={self.page_size}; round up with compute_padded_len"
            )
        num_pages = need_size // self.page_size
        if self.need_sort and self._free.count() < num_pages:
            self.merge_and_sort_free()
        pages = self._free.take(num_pages)
        if pages is None:
            return None
        return pages_to_token_locs(pages, self.page_size)

    def alloc_pages_with_owners(self, page_owners: Sequence[int]) -> torch.Tensor | None:
        """One free page per entry whose CP owner (``page % cp_size``) equals the entry (INV-03).

        Returns the pages' token locs in entry order, or ``None`` (nothing changed) when some owner
        class is short.
        """
        owners = [operator.index(owner) for owner in page_owners]
        # Verify every owner is a rank of the CP group
        for i, owner in enumerate(owners):
            if not 0 <= owner < self.cp_size:
                raise HiCacheInputError(
                    f"page_owners[{i}]={owner} is not a CP rank; owners must be in "
                    f"[0, cp_size) = [0, {self.cp_size})"
                )
        pages = self._free.take_with_owners(owners)
        if pages is None and self.need_sort and self._release_pages:
            self.merge_and_sort_free()
            pages = self._free.take_with_owners(owners)
        if pages is None:
            return None
        # Verify the handed-out pages replay the owner pattern (INV-03)
        for i, (page, owner) in enumerate(zip(pages, owners, strict=True)):
            if page % self.cp_size != owner:
                raise InvariantViolation(
                    "INV-03",
                    f"page_owners[{i}]={owner} got page {page} owned by {page % self.cp_size}",
                )
        return pages_to_token_locs(pages, self.page_size)

    # ------------------------------------------------------------------ free
    def free(self, indices: torch.Tensor) -> None:
        """Free every page that ``indices`` touches (a partial page frees the whole page).

        All pages are checked before any is freed: a refused free changes nothing (INV-17).
        """
        pages = self._pages_to_free(indices)
        if self.need_sort:
            self._release_pages.update(dict.fromkeys(pages))
        else:
            self._free.push(pages)

    def _pages_to_free(self, indices: torch.Tensor) -> list[int]:
        """The unique pages of ``indices``, ascending, after the INV-05 checks."""
        check_index_tensor(indices, "indices")
        # Host-side bookkeeping: a CUDA index tensor is copied to the host here (a sync, as upstream)
        locs = indices.cpu().to(torch.int64) if indices.is_cuda else indices.to(torch.int64)
        values = get_small_cpu_values(locs)
        if values is not None:
            pages = sorted({value // self.page_size for value in values})
        else:
            pages = torch.unique(torch.div(locs, self.page_size, rounding_mode="floor")).tolist()
        for page in pages:
            # Verify the page is one this allocator hands out (INV-05)
            if page == 0:
                raise ForeignSlotError(
                    "INV-05: free() got page 0 (locs 0.."
                    f"{self.page_size - 1}); page 0 is reserved for padded tokens and never handed out"
                )
            if not 1 <= page <= self.num_pages:
                raise ForeignSlotError(
                    f"INV-05: free() got page {page}, outside this allocator's pages "
                    f"[1, {self.num_pages}] (size={self.size}, page_size={self.page_size})"
                )
            # Verify the page is not free already (INV-05)
            if self.is_page_free(page):
                raise DoubleFreeError(
                    f"INV-05: free() got page {page} (locs {page * self.page_size}.."
                    f"{page * self.page_size + self.page_size - 1}), which is free already; "
                    "free each allocation exactly once"
                )
        return [int(page) for page in pages]

    def merge_and_sort_free(self) -> None:
        """Move the release list (``need_sort``) into the free list, ascending."""
        released = sorted(self._release_pages)
        self._release_pages.clear()
        self._free.push(released)

    def clear(self) -> None:
        """Make every allocatable page free again (the order restarts; random is reseeded)."""
        self._release_pages.clear()
        self._free.reset()


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The ``page_size == 1`` allocator: slot 0 is reserved, slots ``1 .. size`` allocatable."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kvcache: KVCache | None,
        need_sort: bool = False,
        *,
        alloc_policy: str = "fifo",
        seed: int = 0,
        cp_layout: CpSharedKVLayout | None = None,
    ) -> None:
        super().__init__(
            size,
            1,
            dtype,
            device,
            kvcache,
            need_sort,
            alloc_policy=alloc_policy,
            seed=seed,
            cp_layout=cp_layout,
        )
