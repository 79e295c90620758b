"""Ownership checkers: conservation (INV-05), no free in flight (INV-07/08), no change (INV-17)."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_ownership import (
    check_failure_reason,
    check_no_device_free_in_flight,
    check_no_free_in_flight,
    check_no_host_free_in_flight,
    check_pages_owned_once,
    check_slot_conservation,
    check_unchanged,
    is_same_value,
)


def detail(excinfo: pytest.ExceptionInfo[InvariantViolation], inv_id: str) -> str:
    assert excinfo.value.inv_id == inv_id
    return excinfo.value.detail


# --- INV-05 ------------------------------------------------------------------------------------


def test_conservation_passes_when_free_and_owned_tile_the_pool() -> None:
    check_slot_conservation(
        8, [6, 7], {"node 1": [0, 1, 2], "load op 4": torch.tensor([3, 4, 5])}, "host"
    )


def test_conservation_with_a_reserved_first_unit() -> None:
    # the paged allocator reserves page 0: units are 1..4
    check_slot_conservation(4, [3, 4], {"node 2": [1, 2]}, "device pages", first_unit=1)


@pytest.mark.parametrize(
    ("free", "owned", "message"),
    [
        pytest.param(
            [2, 3, 3],
            {"node 1": [0, 1]},
            "host unit 3 is in the free list twice (double free; a later alloc would hand it to "
            "two holders)",
            id="double-free",
        ),
        pytest.param(
            [2, 3],
            {"node 1": [0, 1, 2]},
            "host unit 2 is owned by node 1 and also free (freed while still owned, or never "
            "removed from the free list)",
            id="owned-and-free",
        ),
        pytest.param(
            [3],
            {"node 1": [0, 1], "node 2": [1, 2]},
            "host unit 1 is owned by both node 1 and node 2 (each unit has exactly one holder)",
            id="two-holders",
        ),
        pytest.param(
            [3],
            {"node 1": [0, 1]},
            "host units [2] are neither free nor owned (leaked: free 1 + owned 2 != capacity 4)",
            id="leak",
        ),
        pytest.param(
            [3, 9],
            {"node 1": [0, 1, 2]},
            "host free list holds 9, outside [0, 4)",
            id="foreign-free",
        ),
        pytest.param(
            [3],
            {"node 1": [0, 1, 2, 4]},
            "host unit 4 owned by node 1 is outside [0, 4)",
            id="foreign-owned",
        ),
    ],
)
def test_conservation_names_the_broken_unit(
    free: list[int], owned: dict[str, list[int]], message: str
) -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_slot_conservation(4, free, owned, "host")
    assert detail(excinfo, "INV-05") == message


# --- INV-07 / INV-08 ---------------------------------------------------------------------------


def test_freeing_slots_no_transfer_uses_passes() -> None:
    check_no_host_free_in_flight([0, 1], {5: "write op 2 (D2H writes)"}, "evict_host(node 3)")
    check_no_device_free_in_flight(torch.tensor([0, 1]), {5: "load op 4"}, "evict_device")


def test_evict_host_during_a_load_is_caught() -> None:
    # load n1 (H2D reads host slot 17) -> evict_host(n1) before the load ack -> refused
    with pytest.raises(InvariantViolation) as excinfo:
        check_no_host_free_in_flight([16, 17], {17: "load op 4 (H2D reads)"}, "evict_host(node 1)")
    assert str(excinfo.value) == (
        "INV-07 violated: evict_host(node 1) releases host slot 17 while load op 4 (H2D reads) "
        "still uses it (wait for that op's ack)"
    )


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


def test_failure_reason_must_name_the_short_pool() -> None:
    check_failure_reason("draft_host_capacity", "draft_host_capacity", "reserve_write_cp(node 2)")
    with pytest.raises(InvariantViolation) as excinfo:
        check_failure_reason("host_capacity", "draft_host_capacity", "reserve_write_cp(node 2)")
    assert detail(excinfo, "INV-17") == (
        "reserve_write_cp(node 2) was refused with reason='host_capacity' but the cause was "
        "'draft_host_capacity' (the reason tells the caller which pool to evict or whether to "
        "skip the round)"
    )


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
