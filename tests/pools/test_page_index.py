"""The torch page checks: whole aligned pages pass, anything else names INV-01 and the fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_ref.errors import HiCacheInputError, PageAlignmentError
from hicache_ref.pools import pad_token_locs_to_page_boundary, validate_page_aligned_token_indices
from hicache_ref.pools.page_math import pad_locs_to_page_boundary

from .builders import pages_to_locs


def test_aligned_pages_in_any_order_pass() -> None:
    validate_page_aligned_token_indices(pages_to_locs([5, 1, 9], 4), 4, "host_indices")
    validate_page_aligned_token_indices(torch.tensor([3, 0, 7]), 1, "host_indices")
    validate_page_aligned_token_indices(torch.empty(0, dtype=torch.int64), 4, "host_indices")


def test_length_not_a_page_multiple_is_refused() -> None:
    with pytest.raises(
        PageAlignmentError,
        match=r"INV-01: host_indices has 6 token locations, not a multiple of page_size=4",
    ):
        validate_page_aligned_token_indices(torch.arange(6), 4, "host_indices")


def test_misaligned_page_names_the_chunk_and_the_page_it_should_be() -> None:
    # chunk 1 starts at 9: it should be page 2 = [8..11]
    locs = torch.tensor([0, 1, 2, 3, 9, 10, 11, 12])
    with pytest.raises(
        PageAlignmentError,
        match=r"INV-01: device_indices chunk 1 .*\[9, 10, 11, 12\].*page 2 = \[8\.\.11\]",
    ):
        validate_page_aligned_token_indices(locs, 4, "device_indices")


def test_hole_inside_a_page_is_refused() -> None:
    locs = torch.tensor([4, 5, 7, 6])
    with pytest.raises(PageAlignmentError, match=r"INV-01: x chunk 0 .*page 1 = \[4\.\.7\]"):
        validate_page_aligned_token_indices(locs, 4, "x")


def test_non_index_tensors_are_refused() -> None:
    with pytest.raises(HiCacheInputError, match="1-D"):
        validate_page_aligned_token_indices(torch.zeros(2, 4, dtype=torch.int64), 4, "x")
    with pytest.raises(HiCacheInputError, match="integer dtype"):
        validate_page_aligned_token_indices(torch.zeros(4), 4, "x")


def test_padding_extends_the_last_page_with_consecutive_locs() -> None:
    locs = torch.tensor([12, 13, 14, 15, 4, 5])
    assert pad_token_locs_to_page_boundary(locs, 4, "locs").tolist() == [12, 13, 14, 15, 4, 5, 6, 7]


def test_padding_whole_pages_returns_them_unchanged() -> None:
    locs = pages_to_locs([3, 1], 4)
    assert pad_token_locs_to_page_boundary(locs, 4, "locs") is locs
    empty = torch.empty(0, dtype=torch.int64)
    assert pad_token_locs_to_page_boundary(empty, 4, "locs").numel() == 0


def test_padding_refuses_a_tail_that_does_not_start_a_page() -> None:
    with pytest.raises(
        PageAlignmentError,
        match=r"INV-01: write locs partial last page \(positions 4\.\.5\) holds \[5, 6\]",
    ):
        pad_token_locs_to_page_boundary(torch.tensor([12, 13, 14, 15, 5, 6]), 4, "write locs")


def test_padding_refuses_a_broken_full_page() -> None:
    with pytest.raises(PageAlignmentError, match="INV-01: write locs chunk 0"):
        pad_token_locs_to_page_boundary(torch.tensor([12, 13, 15, 14, 4]), 4, "write locs")


@given(
    st.lists(st.integers(min_value=0, max_value=30), max_size=4, unique=True),
    st.integers(min_value=0, max_value=30),
    st.integers(min_value=0, max_value=15),
    st.sampled_from([1, 4, 16]),
)
def test_padding_agrees_with_the_pure_function(
    pages: list[int], tail_page: int, tail_len: int, page_size: int
) -> None:
    tail_len %= page_size
    locs = pages_to_locs(pages, page_size).tolist() + [
        tail_page * page_size + k for k in range(tail_len)
    ]
    padded = pad_token_locs_to_page_boundary(
        torch.tensor(locs, dtype=torch.int64), page_size, "locs"
    )
    assert padded.tolist() == pad_locs_to_page_boundary(locs, page_size)
