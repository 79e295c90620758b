"""INV-39 on hand-built SWA window records: what the tree half hands the checker at a verdict.

A healthy SWA world of two ranks: prefetch ``q`` of a 3-page chain with a 3-page window was cut
to 2 pages for host room; each rank staged 3 window pages, the controller gave the third back,
read the two trailing pages of the served hit with the bytes written for them, and the tree
kept the result. Each bad state changes one thing on one rank, as a bug of upstream's
``_sync_trailing_keys`` or ``_page_transfer_sidecar`` would.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_storage import STORAGE_CHECKS
from hicache_ref.invariants.storage_snapshot import SideWindowRecord, StorageSnapshot

PAGE = 2


def window(rank: int, **changes: object) -> SideWindowRecord:
    record = SideWindowRecord(
        rank=rank,
        request_id="q",
        epoch=1,
        hit_pages=2,
        completed_pages=2,
        staged_pages=3,
        window_pages=2,
        released_pages=1,
        published_pages=2,
        landed=(True, True),
        stored=True,
        read_faulted=False,
        accepted=True,
    )
    return replace(record, **changes)  # type: ignore[arg-type]


def healthy(**rank1: object) -> StorageSnapshot:
    return StorageSnapshot(
        page_size=PAGE,
        world_size=2,
        epoch=1,
        tiers=(),
        prefetches=((), ()),
        backups=((), ()),
        acks=((), ()),
        collectives=((), ()),
        side_windows=(window(0), window(1, **rank1)),
    )


def fires(snapshot: StorageSnapshot, match: str) -> None:
    with pytest.raises(InvariantViolation, match=match) as info:
        STORAGE_CHECKS["INV-39"](snapshot)
    assert info.value.inv_id == "INV-39"


def test_inv39_a_kept_window_of_the_served_hit_passes() -> None:
    STORAGE_CHECKS["INV-39"](healthy())
    # a discard is fine where the window was never whole in L3 (a dropped SWA write)
    STORAGE_CHECKS["INV-39"](
        replace(
            healthy(stored=False, accepted=False, published_pages=0),
            side_windows=(
                window(0, accepted=False, published_pages=0),
                window(1, stored=False, accepted=False, published_pages=0),
            ),
        )
    )


def test_inv39_a_window_counted_without_its_kv_pages_is_caught() -> None:
    # the SWA read ran though one KV page of the hit never landed
    fires(healthy(completed_pages=1, accepted=False), r"SWA hit of 2 page\(s\) with 1 KV page")


def test_inv39_a_window_of_the_queried_hit_kept_after_a_cut_is_caught() -> None:
    # keys re-aligned to the query's 3-page hit: all 3 staged pages read, none given back
    fires(healthy(released_pages=0, landed=(True, True, False)), r"kept with 3 window page\(s\)")
    # a 1-page window read from the page after the cut: the wrong page's bytes
    fires(
        healthy(staged_pages=1, window_pages=1, released_pages=0, landed=(False,)),
        r"window page\(s\) \[0\] of the kept result do not hold",
    )


def test_inv39_a_window_l3_holds_lost_at_the_read_is_caught() -> None:
    # the staged window not shrunk to the cut hit: the read's keys and slots disagree
    lost = {"accepted": False, "published_pages": 0, "released_pages": 0, "landed": ()}
    snapshot = replace(healthy(), side_windows=(window(0, **lost), window(1, **lost)))
    fires(snapshot, r"is not silently lost")
    # ... unless a fault hit a read of it on some rank, or the tree terminated it first
    faulted = replace(
        snapshot, side_windows=(window(0, **lost), window(1, read_faulted=True, **lost))
    )
    STORAGE_CHECKS["INV-39"](faulted)
    ended = replace(snapshot, side_windows=(window(0, terminated=True, **lost), window(1, **lost)))
    STORAGE_CHECKS["INV-39"](ended)


def test_inv39_is_silent_outside_an_swa_world() -> None:
    STORAGE_CHECKS["INV-39"](replace(healthy(), side_windows=()))
