"""Checkers for who holds a slot: conservation (INV-05), no free while in flight (INV-07 host,
INV-08 device), and refused operations that change nothing (INV-17).

A "unit" is whatever the pool counts: a host token slot, a device token slot or a device page.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Literal, TypeVar

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants._convert import IntsLike, shorten, to_ints

Holder = TypeVar("Holder", bound=Hashable)
"""Whoever holds units: a node id, an op, a label."""


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


def check_no_device_free_in_flight(
    freed: IntsLike, in_flight: Mapping[int, str], what: str
) -> None:
    """INV-08: no device slot is freed or reused while an H2D writes it or a D2H reads it."""
    check_no_free_in_flight(freed, in_flight, what, inv_id="INV-08")


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


def check_pool_indices_own(
    pool: str,
    pages: Collection[int],
    allocated: Collection[int],
    others: Collection[int],
    what: str,
) -> None:
    """Raise INV-36 unless every page of indices ``pool`` handed a node is allocated by that
    pool's own allocator and held by no other node (rows or slots from another pool's
    allocator or indices are free in this one, or another node's)."""
    allocated_set, others_set = set(allocated), set(others)
    # Verify each page was handed out by this pool's own allocator
    foreign = sorted(set(pages) - allocated_set)
    if foreign:
        raise InvariantViolation(
            "INV-36",
            f"{what}: {pool} pages {shorten(foreign)} are free in the {pool} pool's own "
            "allocator: they came from another pool's allocator or indices (each pool of a "
            "group allocates its rows and slots from its own allocator)",
        )
    # Verify no page is another node's
    shared = sorted(set(pages) & others_set)
    if shared:
        raise InvariantViolation(
            "INV-36",
            f"{what}: {pool} pages {shorten(shared)} are held by another node in that pool "
            "(a side transfer took another pool's or another node's indices)",
        )


def check_state_slot_count(pool: str, slots: Collection[int], expected: int, what: str) -> None:
    """Raise INV-40 unless a state pool handed a node exactly ``expected`` distinct slots (its
    one state slot): a state counted per token or per anchor page takes slots no other node
    can have, and its extra slots hold no state the harness ever stored."""
    values = list(slots)
    # Verify one state slot per node, never one per token or per anchor page
    if len(values) != expected or len(set(values)) != len(values):
        raise InvariantViolation(
            "INV-40",
            f"{what}: the {pool} pool handed the node {len(values)} state slot(s) "
            f"{shorten(sorted(values))}; a state pool holds {expected} per node (a state is "
            "one slot, not a row per token or a page of the anchor's size)",
        )
