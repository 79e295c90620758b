"""Checkers for where bytes go: page alignment (INV-01), CP owner replay (INV-03), CP metadata (INV-13).

Every checker reads values and may synchronize a device; call them from tests, the harness or
a debug mode, never from the controller's hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants._convert import IntsLike, to_host, to_ints
from hicache_ref.invariants.rules import Problem, find_cp_metadata_problem, find_page_misalignment


def _raise_problem(problem: Problem | None) -> None:
    if problem is not None:
        raise InvariantViolation(problem.inv_id, problem.detail)


def _require_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise HiCacheInputError(f"page_size must be a positive int, got {page_size}")


def check_page_aligned(indices: torch.Tensor, page_size: int, what: str) -> None:
    """Raise INV-01 unless ``indices`` are whole pages, each ``p*page_size + arange(page_size)``."""
    _require_page_size(page_size)
    _raise_problem(find_page_misalignment(to_host(indices), page_size, what))


class CpMetadataLike(Protocol):
    """What ``check_cp_metadata`` reads: any record with the fields of CpHiCacheNodeMetadata."""

    @property
    def logical_len(self) -> int: ...
    @property
    def padded_len(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def owned_positions(self) -> torch.Tensor: ...
    @property
    def host_indices(self) -> torch.Tensor: ...
    @property
    def page_owners(self) -> torch.Tensor: ...
    @property
    def draft_host_indices(self) -> torch.Tensor | None: ...


def check_cp_metadata(meta: CpMetadataLike) -> None:
    """Raise INV-13 (or INV-01 for host indices) unless ``meta`` obeys every metadata rule.

    Unlike the model's validator this reads values of device tensors too (it copies them to
    the CPU), so it also covers records built with ``model_construct`` or on a GPU.
    """
    draft = meta.draft_host_indices
    _raise_problem(
        find_cp_metadata_problem(
            logical_len=meta.logical_len,
            padded_len=meta.padded_len,
            page_size=meta.page_size,
            owned_positions=to_host(meta.owned_positions),
            host_indices=to_host(meta.host_indices),
            page_owners=to_host(meta.page_owners),
            draft_host_indices=None if draft is None else to_host(draft),
        )
    )


def check_host_slot_count(
    host_slots: int, owned_positions: int, what: str, *, pool: str = "host"
) -> None:
    """Raise INV-13 unless an implementation chose one ``pool`` slot per owned position.

    ``owned_positions`` is computed by the caller from its own CP layout (the rank's owned
    positions of the node's logical locations, padded to a page), never read from the
    implementation's metadata; ``host_slots`` is how many slots the implementation recorded.
    A mismatch means bytes of some owned position have nowhere to go, or land in slots that
    mirror no owned page (bug classes 3 and 18).
    """
    # Verify one host slot per owned position, as the harness's layout computes them
    if host_slots != owned_positions:
        raise InvariantViolation(
            "INV-13",
            f"{what}: the metadata records {host_slots} {pool} slots but the CP layout gives "
            f"this rank {owned_positions} owned positions (padded to a page); reserve_write_cp "
            "must allocate exactly one slot per owned position",
        )


def compute_round_robin_owner(logical_page: int, cp_size: int) -> int:
    """The default CP owner of a logical page: pages are dealt to ranks in turn."""
    assert cp_size > 0 and logical_page >= 0
    return logical_page % cp_size


def check_owner_replay(
    allocated_logical_locs: torch.Tensor,
    page_owners: IntsLike,
    page_size: int,
    cp_size: int,
    *,
    owner_of_page: Callable[[int], int] | None = None,
) -> None:
    """Raise INV-03 unless ``load_cp``'s allocation has, page by page, the recorded owners.

    ``allocated_logical_locs`` is what ``alloc_pages_with_owners(page_owners)`` returned;
    ``owner_of_page`` maps a logical page id to its owner rank (round-robin over ``cp_size``
    unless the layout under test says otherwise). Without this replay, the saved
    ``owned_positions`` index pages of another rank and attention reads garbage (bug class 3).
    """
    _require_page_size(page_size)
    if cp_size <= 0:
        raise HiCacheInputError(f"cp_size must be a positive int, got {cp_size}")
    owners = to_ints(page_owners)
    locs = to_host(allocated_logical_locs)
    # Verify the allocation is exactly one page per recorded owner
    if locs.numel() != len(owners) * page_size:
        raise InvariantViolation(
            "INV-03",
            f"load_cp allocated {locs.numel()} slots for {len(owners)} recorded pages "
            f"(expected {len(owners) * page_size} = sum of padded_len)",
        )
    # Verify the allocation is whole aligned pages
    _raise_problem(find_page_misalignment(locs, page_size, "load_cp allocation"))
    owner_of = owner_of_page or (lambda page: compute_round_robin_owner(page, cp_size))
    # Verify each allocated page's owner is the owner recorded at write time
    for position, start in enumerate(to_ints(locs[::page_size])):
        logical_page = start // page_size
        owner = owner_of(logical_page)
        if owner != owners[position]:
            raise InvariantViolation(
                "INV-03",
                f"load_cp put page {position} of the node on logical page {logical_page}, owned "
                f"by rank {owner}, but page_owners[{position}]={owners[position]} was recorded "
                "at write time (alloc_pages_with_owners must replay the recorded owners)",
            )
