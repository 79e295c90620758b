"""Layout checkers: page alignment (INV-01), owner replay (INV-03), CP metadata (INV-13)."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants.checks_layout import (
    check_cp_metadata,
    check_host_slot_count,
    check_owner_replay,
    check_page_aligned,
)
from hicache_ref.invariants.models import CpHiCacheNodeMetadata

from .factories import PAGE, metadata_fields, pages_of


def violation(inv_id: str, detail: str) -> str:
    return f"{inv_id} violated: {detail}"


# --- INV-01 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "indices",
    [pages_of(0), pages_of(48, 16, 2048), torch.empty(0, dtype=torch.int64), pages_of(32).int()],
    ids=["one-page", "pages-in-any-order", "empty", "int32"],
)
def test_page_aligned_accepts_whole_aligned_pages(indices: torch.Tensor) -> None:
    check_page_aligned(indices, PAGE, "host_indices")


@pytest.mark.parametrize(
    ("indices", "detail"),
    [
        pytest.param(
            torch.arange(20),
            "host_indices has 20 indices, not a multiple of page_size=16 (a partial page can "
            "never be copied; pad to 32)",
            id="partial-page",
        ),
        pytest.param(
            torch.arange(4, 36),
            "host_indices page 0 (positions 0..15) starts at 4, not a multiple of page_size=16 "
            "(expected 0 or 16)",
            id="misaligned-start",
        ),
        pytest.param(
            torch.cat([pages_of(0), pages_of(32)[:15], torch.tensor([99])]),
            "host_indices page 1 (positions 16..31) is not one contiguous run: position 31 "
            "holds 99, expected 47",
            id="hole-in-page",
        ),
        pytest.param(
            pages_of(-32),
            "host_indices page 0 (positions 0..15) starts at -32: a negative index is silently "
            "skipped by the transfer kernel (use a real slot)",
            id="negative",
        ),
        pytest.param(
            torch.arange(16, dtype=torch.float32),
            "host_indices must be a 1-D int64 index tensor, got 1-D torch.float32",
            id="float",
        ),
    ],
)
def test_page_aligned_names_the_first_bad_page(indices: torch.Tensor, detail: str) -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_page_aligned(indices, PAGE, "host_indices")
    assert str(excinfo.value) == violation("INV-01", detail)


def test_page_aligned_refuses_a_non_positive_page_size() -> None:
    with pytest.raises(HiCacheInputError, match="page_size must be a positive int, got 0"):
        check_page_aligned(pages_of(0), 0, "host_indices")


# --- INV-13 ------------------------------------------------------------------------------------


def test_cp_metadata_checker_passes_a_valid_record() -> None:
    check_cp_metadata(CpHiCacheNodeMetadata(**metadata_fields(pages=4, cp_size=2, rank=1)))  # type: ignore[arg-type]


def test_cp_metadata_checker_catches_a_record_that_skipped_validation() -> None:
    # model_construct bypasses the validator (a hot-path opt-out); the checker still sees it
    fields = metadata_fields()
    fields["padded_len"] = 20
    meta = CpHiCacheNodeMetadata.model_construct(**fields)  # type: ignore[arg-type]
    with pytest.raises(InvariantViolation) as excinfo:
        check_cp_metadata(meta)
    assert str(excinfo.value) == violation(
        "INV-13",
        "padded_len=20 is not a multiple of page_size=16 (expected 32 for logical_len=29)",
    )


def test_cp_metadata_checker_reports_host_misalignment_as_inv01() -> None:
    fields = metadata_fields()
    fields["host_indices"] = torch.arange(1, 33)
    with pytest.raises(InvariantViolation) as excinfo:
        check_cp_metadata(CpHiCacheNodeMetadata.model_construct(**fields))  # type: ignore[arg-type]
    assert excinfo.value.inv_id == "INV-01"


# --- INV-03 ------------------------------------------------------------------------------------


def test_owner_replay_accepts_an_allocation_with_the_recorded_owners() -> None:
    # recorded owners [1, 0, 1] of cp 2: logical pages 3, 8, 5 have owners 1, 0, 1
    check_owner_replay(pages_of(3 * PAGE, 8 * PAGE, 5 * PAGE), [1, 0, 1], PAGE, 2)


def test_owner_replay_names_the_page_with_the_wrong_owner() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_owner_replay(pages_of(3 * PAGE, 8 * PAGE, 6 * PAGE), [1, 0, 1], PAGE, 2)
    assert str(excinfo.value) == violation(
        "INV-03",
        "load_cp put page 2 of the node on logical page 6, owned by rank 0, but "
        "page_owners[2]=1 was recorded at write time (alloc_pages_with_owners must replay the "
        "recorded owners)",
    )


def test_owner_replay_checks_the_allocation_length() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_owner_replay(pages_of(3 * PAGE), torch.tensor([1, 0], dtype=torch.int8), PAGE, 2)
    assert str(excinfo.value) == violation(
        "INV-03",
        "load_cp allocated 16 slots for 2 recorded pages (expected 32 = sum of padded_len)",
    )


def test_owner_replay_requires_whole_aligned_pages() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_owner_replay(torch.arange(8, 40), [0, 1], PAGE, 2)
    assert excinfo.value.inv_id == "INV-01"


def test_owner_replay_uses_the_layout_owner_function_when_given() -> None:
    # a blocked layout: pages 0-3 on rank 0, 4-7 on rank 1
    check_owner_replay(
        pages_of(5 * PAGE, 1 * PAGE), [1, 0], PAGE, 2, owner_of_page=lambda page: page // 4
    )
    with pytest.raises(InvariantViolation):
        check_owner_replay(pages_of(5 * PAGE, 1 * PAGE), [1, 0], PAGE, 2)


def test_host_slot_count_must_match_the_harness_layout() -> None:
    # the harness computes 6 owned positions from its own CP layout; the metadata recorded 4
    check_host_slot_count(6, 6, "node 2 rank 1")
    with pytest.raises(InvariantViolation) as excinfo:
        check_host_slot_count(4, 6, "node 2 rank 1", pool="draft host")
    assert excinfo.value.inv_id == "INV-13"
    assert excinfo.value.detail.startswith(
        "node 2 rank 1: the metadata records 4 draft host slots but the CP layout gives this "
        "rank 6 owned positions"
    )
