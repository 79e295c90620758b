"""Prefetch accounting checkers (INV-19)."""

from __future__ import annotations

import pytest

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants.checks_prefetch import (
    check_prefetch_progress,
    check_prefetch_release_split,
)


def detail(excinfo: pytest.ExceptionInfo[InvariantViolation]) -> str:
    assert excinfo.value.inv_id == "INV-19"
    return excinfo.value.detail


def test_progress_by_whole_pages_with_bytes_set_passes() -> None:
    check_prefetch_progress(0, 32, 16, pages_with_bytes=2, terminated=False)
    check_prefetch_progress(32, 32, 16, pages_with_bytes=2, terminated=True)


def test_counting_a_page_before_its_bytes_is_caught() -> None:
    # sglang#8901: completed_tokens incremented before set_from_flat_data_page
    with pytest.raises(InvariantViolation) as excinfo:
        check_prefetch_progress(16, 32, 16, pages_with_bytes=1, terminated=False)
    assert detail(excinfo) == (
        "completed_tokens=32 counts more than the 1 pages whose bytes are set (set the page "
        "data before increasing completed_tokens)"
    )


def test_progress_after_terminate_is_caught() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_prefetch_progress(16, 32, 16, pages_with_bytes=2, terminated=True)
    assert detail(excinfo) == (
        "completed_tokens moved 16 -> 32 after terminate_prefetch returned (increment must "
        "refuse once the operation is terminated)"
    )


@pytest.mark.parametrize(("before", "after"), [(32, 16), (0, 8)])
def test_progress_backwards_or_by_partial_pages_is_caught(before: int, after: int) -> None:
    with pytest.raises(InvariantViolation, match=f"moved {before} -> {after} \\(it only grows"):
        check_prefetch_progress(before, after, 16, pages_with_bytes=4, terminated=False)
    with pytest.raises(HiCacheInputError):
        check_prefetch_progress(0, 0, 0, pages_with_bytes=0, terminated=False)


def test_release_split_tiling_the_buffer_passes() -> None:
    # [0:16) freed by the tree, [16:32) inserted, [32:48) released by the tree, [48:64) by the
    # controller, in any order
    check_prefetch_release_split(64, [(32, 48), (0, 16), (48, 64), (16, 32)])
    check_prefetch_release_split(64, [(0, 0), (0, 64), (64, 64)])


def test_range_released_twice_is_caught() -> None:
    # sglang#13483: host_indices[completed:] released in _page_transfer and again by the aux thread
    with pytest.raises(InvariantViolation) as excinfo:
        check_prefetch_release_split(64, [(0, 32), (32, 64), (48, 64)])
    assert detail(excinfo) == (
        "bounce-buffer tokens [48, 64) are released twice (each token of the buffer is released "
        "exactly once)"
    )


def test_range_never_released_is_caught() -> None:
    with pytest.raises(InvariantViolation, match=r"tokens \[16, 32\) are never released"):
        check_prefetch_release_split(64, [(0, 16), (32, 64)])
    with pytest.raises(
        InvariantViolation, match="released ranges end at 48 but the bounce buffer has 64"
    ):
        check_prefetch_release_split(64, [(0, 48)])
    with pytest.raises(InvariantViolation, match=r"released range \[9, 3\) is reversed"):
        check_prefetch_release_split(64, [(9, 3)])
