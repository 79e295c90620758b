"""Properties of the pure page arithmetic (the same contracts CrossHair checks, via Hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from hicache_ref.pools.page_math import (
    compute_num_pages,
    compute_owned_positions,
    compute_padded_len,
    compute_page_owner,
    compute_page_owners,
    compute_physical_loc,
    compute_physical_num_pages,
    expand_copy_runs,
    is_paddable_span,
    is_page_aligned_span,
    is_run_continued,
    pad_locs_to_page_boundary,
    plan_copy_runs,
    split_runs_at_pages,
)

page_sizes = st.sampled_from([1, 2, 4, 16])
cp_sizes = st.integers(min_value=1, max_value=4)


def span_of(pages: list[int], page_size: int) -> list[int]:
    return [page * page_size + offset for page in pages for offset in range(page_size)]


@given(st.integers(min_value=0, max_value=10_000), page_sizes)
def test_padded_len_is_the_next_page_multiple(n: int, page_size: int) -> None:
    # INV-13: logical_len <= padded_len < logical_len + page_size, padded_len a page multiple
    padded = compute_padded_len(n, page_size)
    assert padded % page_size == 0
    assert n <= padded < n + page_size
    assert compute_num_pages(n, page_size) * page_size == padded


def test_padded_len_examples() -> None:
    assert compute_padded_len(0, 4) == 0
    assert compute_padded_len(1, 4) == 4
    assert compute_padded_len(8, 4) == 8
    assert compute_num_pages(9, 4) == 3


@given(st.integers(min_value=0, max_value=1000), cp_sizes)
def test_physical_num_pages_holds_every_logical_page(logical: int, cp_size: int) -> None:
    physical = compute_physical_num_pages(logical, cp_size)
    # every logical page p < logical lands on physical page p // cp_size < physical
    assert all(p // cp_size < physical for p in range(logical))
    # and no page is wasted
    assert logical == 0 or (logical - 1) // cp_size == physical - 1


@given(st.lists(st.integers(min_value=0, max_value=50), max_size=6), page_sizes)
def test_span_built_from_pages_is_aligned_in_any_page_order(
    pages: list[int], page_size: int
) -> None:
    assert is_page_aligned_span(span_of(pages, page_size), page_size)


@given(
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=6),
    st.sampled_from([2, 4, 16]),
    st.data(),
)
def test_one_moved_loc_breaks_alignment(
    pages: list[int], page_size: int, data: st.DataObject
) -> None:
    locs = span_of(pages, page_size)
    position = data.draw(st.integers(min_value=0, max_value=len(locs) - 1))
    locs[position] += data.draw(st.sampled_from([1, page_size + 1, -1]))
    assert not is_page_aligned_span(locs, page_size)


def test_alignment_needs_whole_pages() -> None:
    assert not is_page_aligned_span([0, 1, 2], 4)
    assert not is_page_aligned_span([1, 2, 3, 4], 4)
    assert is_page_aligned_span([8, 9, 10, 11, 0, 1, 2, 3], 4)
    assert is_page_aligned_span([], 4)


@given(
    st.lists(st.integers(min_value=0, max_value=50), max_size=5),
    st.integers(min_value=0, max_value=50),
    st.integers(min_value=0, max_value=15),
    page_sizes,
)
def test_padding_completes_the_last_page(
    pages: list[int], tail_page: int, tail_len: int, page_size: int
) -> None:
    tail_len %= page_size
    locs = span_of(pages, page_size) + [tail_page * page_size + k for k in range(tail_len)]
    assert is_paddable_span(locs, page_size)
    padded = pad_locs_to_page_boundary(locs, page_size)
    assert padded[: len(locs)] == locs
    assert len(padded) == compute_padded_len(len(locs), page_size)
    assert is_page_aligned_span(padded, page_size)


def test_padding_example() -> None:
    # 6 tokens on pages 3 and 1: the second page is extended with 6, 7
    assert pad_locs_to_page_boundary([12, 13, 14, 15, 4, 5], 4) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert not is_paddable_span([12, 13, 14, 15, 5, 6], 4)
    assert not is_paddable_span([12, 14], 4)


@given(st.integers(min_value=0, max_value=10_000), page_sizes, cp_sizes)
def test_physical_loc_keeps_the_offset_and_packs_owned_pages(
    loc: int, page_size: int, cp_size: int
) -> None:
    physical = compute_physical_loc(loc, page_size, cp_size)
    assert physical % page_size == loc % page_size
    assert physical // page_size == loc // page_size // cp_size
    assert 0 <= compute_page_owner(loc // page_size, cp_size) < cp_size


@given(page_sizes, cp_sizes)
def test_each_rank_maps_its_logical_locs_one_to_one(page_size: int, cp_size: int) -> None:
    for rank in range(cp_size):
        owned = [
            loc
            for loc in range(page_size * cp_size * 6)
            if compute_page_owner(loc // page_size, cp_size) == rank
        ]
        physical = [compute_physical_loc(loc, page_size, cp_size) for loc in owned]
        assert len(set(physical)) == len(physical)


@given(
    st.lists(st.integers(min_value=0, max_value=40), max_size=6),
    page_sizes,
    st.integers(min_value=1, max_value=4),
    st.data(),
)
def test_owned_positions_and_page_owners_agree(
    pages: list[int], page_size: int, cp_size: int, data: st.DataObject
) -> None:
    # INV-13: one page_owners entry per page; owned_positions sorted, unique, inside the span
    locs = span_of(pages, page_size)
    owners = compute_page_owners(locs, page_size, cp_size)
    assert owners == [page % cp_size for page in pages]
    rank = data.draw(st.integers(min_value=0, max_value=cp_size - 1))
    positions = compute_owned_positions(locs, page_size, cp_size, rank)
    expected = [
        chunk * page_size + offset
        for chunk, owner in enumerate(owners)
        if owner == rank
        for offset in range(page_size)
    ]
    assert positions == expected
    # the ranks' positions partition the span
    union = sorted(
        p for r in range(cp_size) for p in compute_owned_positions(locs, page_size, cp_size, r)
    )
    assert union == list(range(len(locs)))


index_lists = st.lists(st.integers(min_value=0, max_value=30), max_size=20)


@given(st.data())
def test_copy_runs_reproduce_the_pairs_and_are_maximal(data: st.DataObject) -> None:
    src = data.draw(index_lists)
    dst = data.draw(
        st.lists(st.integers(min_value=0, max_value=30), min_size=len(src), max_size=len(src))
    )
    runs = plan_copy_runs(src, dst)
    assert expand_copy_runs(runs) == (src, dst)
    assert all(length >= 1 for _, _, length in runs)
    assert not any(is_run_continued(a, b) for a, b in itertools.pairwise(runs))


def test_copy_runs_example() -> None:
    # host sorted, device permuted: runs break where either side jumps
    assert plan_copy_runs([0, 1, 2, 3, 8, 9], [4, 5, 12, 13, 6, 7]) == [
        (0, 4, 2),
        (2, 12, 2),
        (8, 6, 2),
    ]
    assert plan_copy_runs([], []) == []


@given(st.data(), page_sizes, st.booleans())
def test_split_runs_stay_inside_one_page(
    data: st.DataObject, page_size: int, split_src: bool
) -> None:
    src = data.draw(index_lists)
    dst = data.draw(
        st.lists(st.integers(min_value=0, max_value=30), min_size=len(src), max_size=len(src))
    )
    runs = split_runs_at_pages(plan_copy_runs(src, dst), page_size, split_src=split_src)
    assert expand_copy_runs(runs) == (src, dst)
    for src_start, dst_start, length in runs:
        start = src_start if split_src else dst_start
        assert start // page_size == (start + length - 1) // page_size
