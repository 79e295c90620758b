"""Checkers for who holds a slot: conservation (INV-05), no free while in flight (INV-07 host,
INV-08 device), and refused operations that change nothing (INV-17).

A "unit" is whatever the pool counts: a host token slot, a device token slot or a device page.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Literal, TypeVar

import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants._convert import IntsLike, shorten, to_ints

Holder = TypeVar("Holder", bound=Hashable)
"""Whoever holds units: a node id, an op, a label."""


def check_slot_conservation(
    capacity_units: int,
    free_units: IntsLike,
    owned: Mapping[Holder, IntsLike],
    what: str,
    *,
    first_unit: int = 0,
) -> None:
    """Raise INV-05 unless every unit in ``[first_unit, first_unit + capacity_units)`` is either
    free (once) or owned by exactly one holder, and nothing else appears.

    ``owned`` maps a holder (a node id, an in-flight op, "prefetch 3", ...) to its units.
    ``first_unit=1`` fits the paged device allocator, which reserves page 0. Catches double
    frees (bug class 14, sglang#13483), frees of foreign slots (sglang#22767) and leaks.
    """
    if capacity_units < 0:
        raise HiCacheInputError(f"capacity_units must be >= 0, got {capacity_units}")
    end = first_unit + capacity_units
    free_seen: set[int] = set()
    for unit in to_ints(free_units):
        # Verify the free list holds only real units, each once
        if not first_unit <= unit < end:
            raise InvariantViolation(
                "INV-05", f"{what} free list holds {unit}, outside [{first_unit}, {end})"
            )
        if unit in free_seen:
            raise InvariantViolation(
                "INV-05",
                f"{what} unit {unit} is in the free list twice (double free; a later alloc "
                "would hand it to two holders)",
            )
        free_seen.add(unit)
    holder_of: dict[int, Holder] = {}
    for holder, units in owned.items():
        for unit in to_ints(units):
            # Verify an owned unit is real, not free, and not owned by anyone else
            if not first_unit <= unit < end:
                raise InvariantViolation(
                    "INV-05",
                    f"{what} unit {unit} owned by {holder} is outside [{first_unit}, {end})",
                )
            if unit in free_seen:
                raise InvariantViolation(
                    "INV-05",
                    f"{what} unit {unit} is owned by {holder} and also free "
                    "(freed while still owned, or never removed from the free list)",
                )
            if unit in holder_of:
                raise InvariantViolation(
                    "INV-05",
                    f"{what} unit {unit} is owned by both {holder_of[unit]} and {holder} "
                    "(each unit has exactly one holder)",
                )
            holder_of[unit] = holder
    # Verify nothing leaked: free + owned == capacity
    if len(free_seen) + len(holder_of) != capacity_units:
        leaked = [u for u in range(first_unit, end) if u not in free_seen and u not in holder_of]
        raise InvariantViolation(
            "INV-05",
            f"{what} units {shorten(leaked)} are neither free nor owned "
            f"(leaked: free {len(free_seen)} + owned {len(holder_of)} != capacity {capacity_units})",
        )


def check_pages_owned_once(
    allocated: Collection[int], owned: Mapping[Holder, Iterable[int]], what: str
) -> None:
    """Raise INV-05 unless the pages a pool reports allocated are exactly the pages the holders
    own, each held by exactly one holder.

    The conservation check for a pool whose free list is its own business: ``allocated`` is
    what the pool (the harness's, not the implementation's) reports, ``owned`` what the tree
    recorded per node. A page allocated but owned by nobody leaked (a refusal that kept half
    its slots, F6); a page owned but free was double-freed or freed early (bug class 14).
    """
    holder_of: dict[int, Holder] = {}
    for holder, pages in owned.items():
        for page in pages:
            # Verify no page has two holders
            if page in holder_of and holder_of[page] != holder:
                raise InvariantViolation(
                    "INV-05",
                    f"{what}: page {page} is owned by nodes {holder_of[page]} and {holder} "
                    "(each page has exactly one holder)",
                )
            holder_of[page] = holder
    allocated_set = set(allocated)
    # Verify allocated == owned: nothing leaked, nothing owned but free
    if allocated_set != set(holder_of):
        leaked = sorted(allocated_set - set(holder_of))
        lost = sorted(set(holder_of) - allocated_set)
        raise InvariantViolation(
            "INV-05",
            f"{what}: pages allocated but owned by no node {shorten(leaked)}; pages owned by a "
            f"node but free {shorten(lost)} (every page is free or owned by exactly one node)",
        )


_UNIT_NAMES = {"INV-07": "host slot", "INV-08": "device slot"}


def check_no_free_in_flight(
    freed: IntsLike,
    in_flight: Mapping[int, str],
    what: str,
    *,
    inv_id: Literal["INV-07", "INV-08"] = "INV-07",
) -> None:
    """Raise ``inv_id`` if ``what`` frees (or hands out again) a unit a transfer still uses.

    ``in_flight`` maps each unit to the op using it (``"load op 4 (H2D reads)"``). Freed host
    slots under an unacked copy get another node's bytes or corrupt this one's (bug class 4,
    sglang#27444); reused device pages get a late H2D (bug class 10, sglang#36738).
    """
    for unit in to_ints(freed):
        # Verify no in-flight transfer still touches the unit
        if unit in in_flight:
            raise InvariantViolation(
                inv_id,
                f"{what} releases {_UNIT_NAMES[inv_id]} {unit} while {in_flight[unit]} still "
                "uses it (wait for that op's ack)",
            )


def check_no_host_free_in_flight(freed: IntsLike, in_flight: Mapping[int, str], what: str) -> None:
    """INV-07: no host slot is freed or reused while a D2H writes it or an H2D reads it."""
    check_no_free_in_flight(freed, in_flight, what, inv_id="INV-07")


def check_no_device_free_in_flight(
    freed: IntsLike, in_flight: Mapping[int, str], what: str
) -> None:
    """INV-08: no device slot is freed or reused while an H2D writes it or a D2H reads it."""
    check_no_free_in_flight(freed, in_flight, what, inv_id="INV-08")


def check_failure_reason(reason: str, expected_reason: str, what: str) -> None:
    """Raise INV-17 unless a refused ``what`` names the cause it was refused for.

    The caller acts on the reason: ``host_capacity`` evicts target host copies and retries,
    ``undrained_ack`` skips the round. A draft-pool shortfall reported as ``host_capacity``
    sends the caller evicting the wrong pool, possibly forever.
    """
    # Verify the reported cause is the actual cause
    if reason != expected_reason:
        raise InvariantViolation(
            "INV-17",
            f"{what} was refused with reason={reason!r} but the cause was {expected_reason!r} "
            "(the reason tells the caller which pool to evict or whether to skip the round)",
        )


def is_same_value(left: object, right: object) -> bool:
    """Equality that also works for tensors (same dtype, shape and values) and nests."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return (
            isinstance(left, torch.Tensor)
            and isinstance(right, torch.Tensor)
            and left.dtype == right.dtype
            and torch.equal(left.cpu(), right.cpu())
        )
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(is_same_value(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return len(left) == len(right) and all(
            is_same_value(a, b) for a, b in zip(left, right, strict=True)
        )
    return left == right


def _brief(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_unchanged(
    before_snapshot: Mapping[str, object], after_snapshot: Mapping[str, object], what: str
) -> None:
    """Raise INV-17 if a refused or failed ``what`` changed any part of the state snapshot.

    A snapshot maps a part's name (``"host free list"``, ``"allocator free pages"``) to a value
    (ints, lists, tensors). A write refused for capacity must not keep half its host slots,
    and a load that raised must give its device pages back.
    """
    for key in sorted(set(before_snapshot) | set(after_snapshot)):
        before, after = before_snapshot.get(key), after_snapshot.get(key)
        # Verify this part of the state is exactly as before
        if (
            key not in before_snapshot
            or key not in after_snapshot
            or not is_same_value(before, after)
        ):
            raise InvariantViolation(
                "INV-17",
                f"{what} was refused or failed but changed {key!r}: before {_brief(before)}, "
                f"after {_brief(after)} (a failed operation must leave the pools exactly as "
                "they were)",
            )
