"""The Python paths for small CPU index tensors give the torch paths' answers, errors included.

Up to ``SMALL_INDEX_MAX`` values the page checks, page sets and transfer checks read
``tolist()`` instead of calling torch ops on tiny tensors. Each test runs one check twice on
the same random input, once as shipped and once with the limit at 0 (every tensor takes the
torch path), and requires the same result or the same error message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ref.controller.cp_write import _plan_owned
from hicache_ref.controller.inflight import pages_of
from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, PageAlignmentError
from hicache_ref.pools import CpSharedKVLayout, PagedTokenToKVPoolAllocator, page_index
from hicache_ref.pools.page_index import (
    pad_token_locs_to_page_boundary,
    validate_page_aligned_token_indices,
)
from hicache_ref.pools.transfer_checks import (
    check_page_first_direct_chunks,
    check_transfer_indices,
)

from .builders import make_pools

LOCS = st.lists(st.integers(-3, 70), max_size=24)
PAGE = st.sampled_from([1, 2, 4])


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """What ``fn`` gives: its value, or the type and message of the input error it raises."""
    try:
        value = fn()
    except (HiCacheInputError, PageAlignmentError) as error:
        return type(error).__name__, str(error)
    if isinstance(value, tuple):
        return "value", tuple(v.tolist() if isinstance(v, torch.Tensor) else v for v in value)
    return "value", value.tolist() if isinstance(value, torch.Tensor) else value


def both_paths(fn: Callable[[], Any]) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """(``fn`` as shipped, ``fn`` with every tensor on the torch path)."""
    small = outcome(fn)
    saved = page_index.SMALL_INDEX_MAX
    page_index.SMALL_INDEX_MAX = 0
    try:
        large = outcome(fn)
    finally:
        page_index.SMALL_INDEX_MAX = saved
    return small, large


@settings(max_examples=150, deadline=None)
@given(locs=LOCS, page=PAGE)
def test_page_alignment_is_judged_alike(locs: list[int], page: int) -> None:
    indices = torch.tensor(locs, dtype=torch.int64)
    small, large = both_paths(lambda: validate_page_aligned_token_indices(indices, page, "x"))
    assert small == large


@settings(max_examples=100, deadline=None)
@given(pages=st.lists(st.integers(0, 15), max_size=8), page=PAGE, shuffle=st.randoms())
def test_aligned_pages_pass_and_their_page_sets_agree(
    pages: list[int], page: int, shuffle: Any
) -> None:
    locs = [p * page + o for p in pages for o in range(page)]
    indices = torch.tensor(locs, dtype=torch.int64)
    assert both_paths(lambda: validate_page_aligned_token_indices(indices, page, "x")) == (
        ("value", None),
        ("value", None),
    )
    shuffle.shuffle(locs)
    shuffled = torch.tensor(locs, dtype=torch.int64)
    small, large = both_paths(lambda: pages_of(shuffled, page))
    assert small == large == ("value", frozenset(pages))


@settings(max_examples=150, deadline=None)
@given(host=LOCS, device=LOCS, d2h=st.booleans())
def test_transfer_index_checks_agree(host: list[int], device: list[int], d2h: bool) -> None:
    host_t, device_t = (
        torch.tensor(host, dtype=torch.int64),
        torch.tensor(device, dtype=torch.int64),
    )
    small, large = both_paths(
        lambda: check_transfer_indices(
            host_t, device_t, direction="d2h" if d2h else "h2d", host_size=64, device_rows=48
        )
    )
    assert small == large


@settings(max_examples=100, deadline=None)
@given(pages=st.lists(st.integers(0, 15), max_size=6), page=PAGE, data=st.data())
def test_whole_page_chunk_checks_agree(pages: list[int], page: int, data: st.DataObject) -> None:
    host = torch.tensor([p * page + o for p in pages for o in range(page)], dtype=torch.int64)
    device_locs = data.draw(st.lists(st.integers(0, 70), min_size=len(host), max_size=len(host)))
    device = torch.tensor(device_locs, dtype=torch.int64)
    small, large = both_paths(lambda: check_page_first_direct_chunks(host, device, page))
    assert small == large


@settings(max_examples=100, deadline=None)
@given(
    locs=st.lists(st.integers(0, 95), max_size=24),
    page=PAGE,
    cp_size=st.integers(1, 4),
    data=st.data(),
)
def test_owned_physical_pages_equal_the_tensor_form(
    locs: list[int], page: int, cp_size: int, data: st.DataObject
) -> None:
    layout = CpSharedKVLayout(cp_size, data.draw(st.integers(0, cp_size - 1)), page)
    indices = torch.tensor(locs, dtype=torch.int64)
    owned = indices[layout.owned_by_this_rank(indices)]
    expected = frozenset(
        (layout.logical_locs_to_physical(owned) // page).tolist() if owned.numel() else []
    )
    assert layout.owned_physical_pages_of_list(locs) == expected


@settings(max_examples=60, deadline=None)
@given(frees=st.lists(st.integers(-1, 12), max_size=10), page=PAGE)
def test_device_frees_are_refused_or_done_alike(frees: list[int], page: int) -> None:
    def free_on_a_fresh_allocator() -> tuple[list[int], ...]:
        allocator = PagedTokenToKVPoolAllocator(10 * page, page, torch.float64, "cpu", None)
        held = allocator.alloc(6 * page)
        assert held is not None
        allocator.free(torch.tensor([max(f, 0) * page for f in frees], dtype=torch.int64))
        return (allocator.free_page_ids(),)

    small, large = both_paths(free_on_a_fresh_allocator)
    assert small == large


@pytest.mark.parametrize("slots", [[0, 1, 2], [-1, 3], [63, 64], []])
def test_host_row_reads_are_bounded_alike(slots: list[int]) -> None:
    _, host_pool = make_pools("mla", SimDevice(), host_size=64)
    indices = torch.tensor(slots, dtype=torch.int64)
    small, large = both_paths(lambda: host_pool.read_rows("kv", 0, indices))
    assert small == large


@settings(max_examples=150, deadline=None)
@given(locs=LOCS, page=PAGE)
def test_padding_to_a_page_boundary_pads_and_refuses_alike(locs: list[int], page: int) -> None:
    indices = torch.tensor(locs, dtype=torch.int64)
    small, large = both_paths(lambda: pad_token_locs_to_page_boundary(indices, page, "x"))
    assert small == large


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 10), length=st.integers(1, 11), page=PAGE)
def test_a_partial_last_page_is_padded_alike(start: int, length: int, page: int) -> None:
    indices = torch.arange(start * page, start * page + length, dtype=torch.int32)
    small, large = both_paths(lambda: pad_token_locs_to_page_boundary(indices, page, "x"))
    assert small == large and small[0] == "value"
    assert pad_token_locs_to_page_boundary(indices, page, "x").dtype == torch.int32


@settings(max_examples=100, deadline=None)
@given(
    pages=st.lists(st.integers(0, 23), max_size=8),
    page=PAGE,
    cp_size=st.integers(1, 4),
    data=st.data(),
)
def test_a_cp_plan_in_python_equals_the_tensor_form(
    pages: list[int], page: int, cp_size: int, data: st.DataObject
) -> None:
    layout = CpSharedKVLayout(cp_size, data.draw(st.integers(0, cp_size - 1)), page)
    padded = torch.tensor([p * page + o for p in pages for o in range(page)], dtype=torch.int64)
    positions, physical, owners = layout.plan_owned_of_list(padded.tolist())
    mask = layout.owned_by_this_rank(padded)
    assert positions == mask.nonzero(as_tuple=True)[0].tolist()
    assert physical == layout.logical_locs_to_physical(padded[mask]).tolist()
    assert owners == layout.owner_for_logical_pages(torch.tensor(pages, dtype=torch.int64)).tolist()


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.integers(0, 23), max_size=6), page=PAGE, cp_size=st.integers(1, 4))
def test_the_reservation_plan_is_the_same_tensors_on_both_paths(
    pages: list[int], page: int, cp_size: int
) -> None:
    layout = CpSharedKVLayout(cp_size, cp_size - 1, page)
    padded = torch.tensor([p * page + o for p in pages for o in range(page)], dtype=torch.int32)
    small, large = both_paths(lambda: _plan_owned(layout, padded))
    assert small == large
    dtypes = [t.dtype for t in _plan_owned(layout, padded)]
    assert dtypes == [torch.int64, torch.int32, torch.int8]
