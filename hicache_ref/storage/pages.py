"""Page-granular views of host index tensors, checked for alignment (INV-01).

Storage reads and writes one page per key and locates it by the page's first host slot, so a
span whose pages are not ``p * page_size + arange(page_size)`` would silently move the wrong
bytes (bug class 18). Every span that enters the storage tier is checked here first.
"""

from __future__ import annotations

import torch

from hicache_ref.errors import HiCacheInputError, PageAlignmentError
from hicache_ref.ids import HostSlot
from hicache_ref.pools.page_math import is_page_aligned_span


def require_page_aligned(host_indices: torch.Tensor, page_size: int, what: str) -> None:
    """Raise ``PageAlignmentError`` unless ``host_indices`` is whole aligned pages (INV-01)."""
    # Verify a 1-D integer tensor: anything else cannot name host slots
    if host_indices.dim() != 1 or host_indices.dtype not in (torch.int64, torch.int32):
        raise HiCacheInputError(
            f"{what} must be a 1-D int64/int32 tensor of host slots, got shape "
            f"{tuple(host_indices.shape)} dtype {host_indices.dtype}"
        )
    # Verify whole aligned pages (INV-01): storage addresses a page by its first slot
    if not is_page_aligned_span(host_indices.tolist(), page_size):
        raise PageAlignmentError(
            f"INV-01: {what} ({host_indices.numel()} slots) is not whole aligned pages of "
            f"{page_size}; each chunk must be p*{page_size} + arange({page_size}) "
            "(allocate and free host slots in whole pages)"
        )


def split_pages(host_indices: torch.Tensor, page_size: int) -> list[torch.Tensor]:
    """One tensor per page of an aligned span; an empty span gives no pages (sglang#11005)."""
    if host_indices.numel() == 0:
        return []
    return [
        host_indices[start : start + page_size]
        for start in range(0, host_indices.numel(), page_size)
    ]


def get_page_head(host_indices: torch.Tensor, page_index: int, page_size: int) -> HostSlot:
    """The first host slot of page ``page_index`` of an aligned span."""
    return HostSlot(int(host_indices[page_index * page_size]))
