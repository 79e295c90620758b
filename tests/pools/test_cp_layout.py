"""The vectorised CP layout equals the pure page arithmetic for every rank of cp 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools import CpSharedKVLayout
from hicache_ref.pools.page_math import (
    compute_owned_positions,
    compute_page_owner,
    compute_physical_loc,
    compute_physical_num_pages,
)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_layout_matches_the_pure_functions(cp_size: int, page_size: int) -> None:
    locs = torch.randperm(page_size * 24, generator=torch.Generator().manual_seed(cp_size))
    loc_list = locs.tolist()
    for cp_rank in range(cp_size):
        layout = CpSharedKVLayout(cp_size, cp_rank, page_size)
        pages = torch.div(locs, page_size, rounding_mode="floor")
        assert layout.owner_for_logical_pages(pages).tolist() == [
            compute_page_owner(p, cp_size) for p in pages.tolist()
        ]
        owned = layout.owned_by_this_rank(locs)
        assert owned.dtype == torch.bool
        assert owned.nonzero(as_tuple=True)[0].tolist() == compute_owned_positions(
            loc_list, page_size, cp_size, cp_rank
        )
        assert layout.logical_locs_to_physical(locs).tolist() == [
            compute_physical_loc(loc, page_size, cp_size) for loc in loc_list
        ]


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_physical_pages_hold_every_owned_logical_page(cp_size: int) -> None:
    page_size = 4
    logical_pages = 9  # pages 0..8, page 0 being the padding page
    layout = CpSharedKVLayout(cp_size, 0, page_size)
    physical_pages = layout.physical_num_pages(logical_pages)
    assert physical_pages == compute_physical_num_pages(logical_pages, cp_size)
    locs = torch.arange(logical_pages * page_size)
    assert int(layout.logical_locs_to_physical(locs).max()) < physical_pages * page_size


def test_physical_locs_of_one_rank_are_distinct_and_keep_page_offsets() -> None:
    layout = CpSharedKVLayout(cp_size=2, cp_rank=1, page_size=4)
    locs = torch.arange(64)
    mine = locs[layout.owned_by_this_rank(locs)]
    physical = layout.logical_locs_to_physical(mine)
    assert torch.unique(physical).numel() == physical.numel()
    assert torch.equal(physical % 4, mine % 4)
    # logical page 3 (owner 1) lives at physical page 1 on rank 1
    assert layout.logical_locs_to_physical(torch.tensor([12, 13, 14, 15])).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("cp_size", "cp_rank", "page_size", "message"),
    [
        (0, 0, 4, r"cp_size must be >= 1"),
        (2, 2, 4, r"cp_rank must be in \[0, cp_size\) = \[0, 2\), got 2"),
        (2, -1, 4, r"cp_rank must be in"),
        (2, 0, 0, r"page_size must be >= 1"),
    ],
)
def test_bad_layout_arguments_are_refused(
    cp_size: int, cp_rank: int, page_size: int, message: str
) -> None:
    with pytest.raises(HiCacheInputError, match=message):
        CpSharedKVLayout(cp_size, cp_rank, page_size)
