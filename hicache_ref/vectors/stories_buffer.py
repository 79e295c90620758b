"""Scenes of buffer mode (INV-41): host pages as write staging, beliefs of what L3 holds.

Buffer world: the storage tier's default world (``stories_storage.STORAGE_WORLD``: two ranks,
one-page batches) in ``buffer_only`` host memory, so each rank's tree keeps storage existence
beliefs, taught at a write's storage ack (whatever the backend did), healed by a drained hit
query's rank-agreed verdict, and skips a write whose pages it believes stored or in flight.
Every step's checks judge the beliefs against the harness's own record (INV-41). Listed after
the side pool's window in L3.
"""

from __future__ import annotations

from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.stories_storage import STORAGE_WORLD, backup_steps, hit, to_l3
from hicache_ref.vectors.storybook import story

BUFFER_WORLD: dict[str, object] = {**STORAGE_WORLD, "storage_buffer_only": True}


@story(
    "story-inv41-a-write-is-believed-from-its-storage-ack",
    "INV-41",
    "a write's pages are in flight from its launch and believed stored from its storage ack",
    **BUFFER_WORLD,
)
def _inv41_ack(r: Recorder) -> None:
    r.apply("write_storage", {"pick": 2, "new": True}, note="three pages in flight, staged")
    backup_steps(r, note="the backup runs; nothing believed before its ack is drained")
    r.apply("drain_backup_acks", inv="INV-41", note="believed stored on every rank, staging freed")


@story(
    "story-inv41-a-failed-write-is-believed-so-not-written-again",
    "INV-41",
    "a write every rank's backend failed is still believed stored, so writing it again is skipped",
    **BUFFER_WORLD,
)
def _inv41_stale(r: Recorder) -> None:
    for rank in (0, 1):
        r.apply(
            "inject_fault",
            {"fault": "set_fail", "rank": rank, "pages": 3},
            note=f"rank {rank}'s sets fail",
        )
    to_l3(r, pick=2, note="L3 keeps none of the chain; its ack teaches it all the same")
    r.apply(
        "write_storage",
        {"pick": 0, "new": False},
        inv="INV-41",
        note="refused: every page believed stored (the stale positive a query heals)",
    )


@story(
    "story-inv41-an-agreed-miss-forgets-the-missing-pages",
    "INV-41",
    "a hit query whose rank-agreed verdict misses believed pages forgets them on every rank",
    **BUFFER_WORLD,
)
def _inv41_heal(r: Recorder) -> None:
    to_l3(r, pick=2, note="a three-page chain believed stored on every rank")
    r.apply(
        "inject_fault",
        {"fault": "exists_miss", "rank": 1, "pages": 2},
        note="rank 1's backend misses the chain's first page",
    )
    hit(r, inv="INV-41", note="MIN(3, 0) = 0 pages: the whole chain forgotten on every rank")
