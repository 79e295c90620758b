"""Scenes of the windows inside a storage thread's loop body: one story per INV-32 .. INV-35,
INV-19's page window and INV-37's draft sidecar read.

Worlds with schedule points (``storage_points``): every storage step runs one thread, on every
rank, to its next point (a backend call, a collective, a put, its wait), and ``schedule_point``
grants a thread parked at a backend call with a drawn outcome. So a vector fixes where the tree
acts between two calls of one loop body, and an implementation's threads are checked at that
granularity. With page points (``storage_page_points``) the IO also parks before each host page
it writes from a read, so a progress ack put between two page writes is visible on its own.
Registered after ``stories_storage.py``'s scenes.
"""

from __future__ import annotations

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.stories_storage import STORAGE_WORLD, _driver, _runnable, hit, to_l3
from hicache_ref.vectors.storybook import story

POINTS_WORLD: dict[str, object] = {**STORAGE_WORLD, "storage_points": True}
GRANTS_MAX = 48  # bound on a scene's grants (a chain has at most three pages)


def grant(r: Recorder, kind: str, times: int = 1, inv: str | None = None, note: str = "") -> None:
    """``times`` grants of the ``kind`` threads, each to its next point (while they can move)."""
    for _ in range(times):
        if not _runnable(r, StorageStepKind(kind)):
            return
        r.apply("storage_step", {"kind": kind}, inv=inv, note=note or f"the {kind} threads move")


def hit_to_io(r: Recorder, pick: int, note: str) -> str:
    """A chain to L3, then a prefetch of it whose hit query runs to its wait and whose hit is
    drained (the bounce pages allocated): the IO is next. Returns the prefetch's request id."""
    to_l3(r, pick=pick, note=note)
    rid = hit(r)
    grant(r, "hit_query", times=GRANTS_MAX, note="the hit query runs to its wait")
    r.apply("drain_prefetch_acks", note="the hit: bounce pages allocated")
    return rid


def finish_all(r: Recorder, inv: str | None = None, note: str = "") -> None:
    """Every thread to its wait, with drains, until nothing can move."""
    for _ in range(GRANTS_MAX):
        runnable = [k.value for k in _driver(r).runnable()]
        if not runnable:
            break
        grant(r, runnable[0])
        r.apply("drain_prefetch_acks", note="what the threads published so far")
    r.apply("drain_prefetch_acks", note="the last acks")
    r.apply("drain_backup_acks", inv=inv, note=note or "the backup acks and releases")


@story(
    "story-inv32-an-acked-backup-is-in-l3-at-the-drain",
    "INV-32",
    "the tree drains a backup ack while the thread is parked after it: its pages are in L3",
    **POINTS_WORLD,
)
def _inv32(r: Recorder) -> None:
    r.apply("write_storage", {"pick": 1, "new": True}, note="a chain of two pages to back up")
    grant(r, "backup", times=3, note="two batch_set calls, then parked at the ack's put")
    r.apply("drain_backup_acks", note="nothing acked yet: the put has not run")
    grant(r, "backup", note="the ack is put; the thread parks at its wait")
    r.apply("drain_backup_acks", inv="INV-32", note="every page the ack counts reads back")


@story(
    "story-inv33-no-read-after-termination",
    "INV-33",
    "a prefetch terminated between its batches reads no further page",
    **POINTS_WORLD,
)
def _inv33(r: Recorder) -> None:
    rid = hit_to_io(r, pick=2, note="a chain of three pages")
    grant(r, "io", times=2, note="the first batch read; parked at its progress ack's put")
    r.apply("terminate_prefetch", {"request": rid}, note="terminated between two batches")
    finish_all(r, inv="INV-33", note="the IO looked before its next batch: no read after")


@story(
    "story-inv34-progress-stops-at-a-hole",
    "INV-34",
    "one page of a batch comes back empty: progress counts only the pages before it",
    **{**POINTS_WORLD, "storage_batch_pages": 2},
)
def _inv34(r: Recorder) -> None:
    hit_to_io(r, pick=1, note="a chain of two pages, one batch")
    grant(r, "io", note="the IO takes the prefetch and parks at its batch_get")
    r.apply(
        "schedule_point",
        {"thread": "io", "outcome": "hole", "rank": 0, "at": 0},
        note="rank 0's batch_get: its first page comes back empty, the second does not",
    )
    finish_all(r, inv="INV-34", note="rank 0 counted no page; the MIN is published")


@story(
    "story-inv35-reset-joins-a-thread-parked-mid-body",
    "INV-35",
    "a reset while the backup thread is parked at a batch_set: no old thread runs again",
    **{**POINTS_WORLD, "storage_ranks": 1},
)
def _inv35(r: Recorder) -> None:
    r.apply("write_storage", {"pick": 1, "new": True}, note="a chain of two pages to back up")
    grant(r, "backup", note="parked at its first batch_set")
    r.apply("reset_storage_in_flight", note="the reset joins it: its body runs to the end")
    to_l3(r, pick=0, inv="INV-35", note="only the new epoch's threads are granted")


@story(
    "story-inv25-a-raise-inside-the-io-loop-still-acks-once",
    "INV-25",
    "rank 1's backend raises at one batch_get of the IO loop: still exactly one final ack",
    **POINTS_WORLD,
)
def _inv25_points(r: Recorder) -> None:
    hit_to_io(r, pick=1, note="a chain of two pages")
    grant(r, "io", note="the IO takes the prefetch and parks at its batch_get")
    r.apply(
        "schedule_point",
        {"thread": "io", "outcome": "raise", "rank": 1, "at": 0},
        note="rank 1's backend raises inside the loop body",
    )
    finish_all(r, inv="INV-25", note="one final ack per rank, the MIN published")


@story(
    "story-inv19-an-io-ack-counts-only-landed-pages",
    "INV-19",
    "the IO parks before each page it writes: every progress ack it puts counts landed pages only",
    **{**POINTS_WORLD, "storage_page_points": True, "storage_ranks": 1},
)
def _inv19_pages(r: Recorder) -> None:
    hit_to_io(r, pick=1, note="a chain of two pages, one per batch")
    grant(
        r,
        "io",
        times=GRANTS_MAX,
        inv="INV-19",
        note="one point at a time: a batch_get, its page write, its progress ack",
    )
    finish_all(r, inv="INV-19", note="the prefetch's pages read back as L3 holds them")


@story(
    "story-inv37-a-page-counts-only-with-its-draft-page",
    "INV-37",
    "a draft sidecar's read comes back empty at one page: progress stops before it",
    **{**POINTS_WORLD, "storage_batch_pages": 2, "draft_layer_num": 2},
)
def _inv37_sidecar(r: Recorder) -> None:
    hit_to_io(r, pick=1, note="a chain of two pages, one batch, its draft pages beside them")
    grant(r, "io", note="the IO takes the prefetch and parks at its KV batch_get")
    grant(r, "io", note="both KV pages land; parked at the draft pages' batch_get")
    r.apply(
        "schedule_point",
        {"thread": "io", "outcome": "hole", "rank": 0, "at": 1},
        note="rank 0's draft read: its second page comes back empty",
    )
    finish_all(r, inv="INV-37", note="rank 0 counted one page, not the KV's two")
