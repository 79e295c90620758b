"""Ownership checkers: conservation (INV-05), no free in flight (INV-07/08), no change (INV-17)."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_ownership import (
    check_no_device_free_in_flight,
    check_no_free_in_flight,
    check_pages_owned_once,
    check_unchanged,
    is_same_value,
)


def detail(excinfo: pytest.ExceptionInfo[InvariantViolation], inv_id: str) -> str:
    assert excinfo.value.inv_id == inv_id
    return excinfo.value.detail


# --- INV-05 ------------------------------------------------------------------------------------


# --- INV-07 / INV-08 ---------------------------------------------------------------------------


def test_reusing_a_device_page_under_an_h2d_is_caught() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_no_device_free_in_flight([64], {64: "load op 9 (H2D writes)"}, "alloc for node 4")
    assert detail(excinfo, "INV-08") == (
        "alloc for node 4 releases device slot 64 while load op 9 (H2D writes) still uses it "
        "(wait for that op's ack)"
    )


def test_generic_in_flight_check_takes_the_id() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_no_free_in_flight([1], {1: "write op 1"}, "free", inv_id="INV-08")
    assert excinfo.value.inv_id == "INV-08"


# --- INV-17 ------------------------------------------------------------------------------------


def test_unchanged_snapshot_passes() -> None:
    before = {"host free": torch.arange(4), "available": 4, "queues": {"write": [1, 2]}}
    after = {"host free": torch.arange(4), "available": 4, "queues": {"write": [1, 2]}}
    check_unchanged(before, after, "reserve_write_cp(node 3)")


def test_a_half_allocated_refusal_is_caught() -> None:
    # reserve_write_cp: host alloc ok, draft host alloc fails -> must give the host slots back
    before = {"host free": torch.arange(8), "draft host free": torch.arange(2)}
    after = {"host free": torch.arange(4, 8), "draft host free": torch.arange(2)}
    with pytest.raises(InvariantViolation) as excinfo:
        check_unchanged(before, after, "reserve_write_cp(node 3)")
    assert detail(excinfo, "INV-17").startswith(
        "reserve_write_cp(node 3) was refused or failed but changed 'host free': before "
        "tensor([0, 1, 2, 3, 4, 5, 6, 7]), after tensor([4, 5, 6, 7])"
    )


def test_a_missing_snapshot_part_counts_as_a_change() -> None:
    with pytest.raises(InvariantViolation, match="changed 'ack_write_queue'"):
        check_unchanged({"ack_write_queue": []}, {}, "load_cp")


def test_same_value_compares_tensors_by_dtype_and_values() -> None:
    assert is_same_value(torch.arange(3), torch.arange(3))
    assert not is_same_value(torch.arange(3), torch.arange(3).int())
    assert not is_same_value(torch.arange(3), [0, 1, 2])
    assert is_same_value((1, [torch.ones(2)]), [1, (torch.ones(2),)])


# --- INV-05: allocated pages against the tree's holders ---------------------------------------


def test_pages_owned_once_passes_when_the_pool_and_the_nodes_agree() -> None:
    check_pages_owned_once({1, 2, 5}, {"node 0": [1, 2], "node 3": {5}}, "rank 0 host pool")


@pytest.mark.parametrize(
    ("allocated", "owned", "message"),
    [
        # a refusal kept a slot: allocated, owned by nobody
        ({1, 2, 7}, {"node 0": [1, 2]}, "pages allocated but owned by no node [7]"),
        # a double free: owned, but the pool says free
        ({1}, {"node 0": [1, 2]}, "pages owned by a node but free [2]"),
        # two nodes hold one page
        ({1, 2}, {"node 0": [1, 2], "node 4": [2]}, "page 2 is owned by nodes node 0 and node 4"),
    ],
)
def test_pages_owned_once_names_the_broken_page(
    allocated: set[int], owned: dict[str, list[int]], message: str
) -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_pages_owned_once(allocated, owned, "rank 1 host pool")
    text = detail(excinfo, "INV-05")
    assert text.startswith("rank 1 host pool: ") and message in text
