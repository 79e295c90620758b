"""Scenes of the L3 storage tier: one story per storage invariant (INV-19 .. INV-31).

Default storage world: the stories' base geometry with two TP ranks, one-page storage batches
(so a chain of pages takes several IO and backup steps, and a fault lands between them) and
room on the host for backups and a prefetch's bounce pages. Every thread step is a step of the
vector (``storage_step``), so what a drain of storage acks answers is fixed by the steps before
it. The verbs: ``to_l3`` (a new chain, backed up and acked), ``hit`` (a prefetch of it and its
rank-reduced hit drained), ``run_storage`` (every runnable step of the named threads, with
drains). Listed last, after ``stories.py``'s and ``stories_regressions.py``'s scenes.
"""

from __future__ import annotations

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.storybook import story

STORAGE_WORLD: dict[str, object] = {
    "host_pages": 24,
    "storage_ranks": 2,
    "storage_batch_pages": 1,
}
STEPS_MAX = 24  # bound on a scene's thread steps (a chain has at most three pages)


def _driver(r: Recorder) -> StorageDriver:
    storage = r.session.storage
    assert storage is not None, "a storage story runs in a storage world"
    return storage


def _runnable(r: Recorder, kind: StorageStepKind) -> bool:
    d = _driver(r)
    return d.attached and kind in d.runnable()


def to_l3(r: Recorder, pick: int = 1, inv: str | None = None, note: str = "") -> int:
    """A new chain (``1 + pick % 3`` pages) written to L3 on every rank, its backup acked."""
    uid = r.session.tree.next_handle
    r.apply("write_storage", {"pick": pick, "new": True}, note=f"chain {uid} to L3")
    backup_steps(r, inv=inv, note=note)
    r.apply("drain_backup_acks", note="one backup ack per rank; source pages freed")
    return uid


def backup_steps(r: Recorder, inv: str | None = None, note: str = "") -> None:
    for _ in range(STEPS_MAX):
        if not _runnable(r, StorageStepKind.BACKUP):
            return
        r.apply("storage_step", {"kind": "backup"}, inv=inv, note=note or "one backup batch")


def hit(r: Recorder, inv: str | None = None, note: str = "") -> str:
    """A prefetch of the newest chain in L3: its hit query on every rank, the hit drained."""
    candidates = _driver(r).prefetch_candidates()
    r.apply("prefetch", {"pick": len(candidates) - 1}, note="prefetch the chain")
    rid = _driver(r).ongoing()[-1]
    r.apply("storage_step", {"kind": "hit_query"}, note="each rank asks its backend")
    r.apply("drain_prefetch_acks", inv=inv, note=note or "the MIN hit: bounce pages allocated")
    return rid


def run_storage(
    r: Recorder, kinds: tuple[str, ...] = ("io", "sync"), inv: str | None = None, note: str = ""
) -> None:
    """Every runnable step of ``kinds`` until none is left, a drain after each round."""
    for _ in range(STEPS_MAX):
        ran = False
        for kind in kinds:
            if _runnable(r, StorageStepKind(kind)):
                r.apply("storage_step", {"kind": kind}, note=f"one {kind} step on every rank")
                ran = True
        if not ran:
            break
        r.apply("drain_prefetch_acks", note="progress published so far")
    r.apply("drain_prefetch_acks", inv=inv, note=note or "the final ack: [0:completed] inserted")
    r.apply("drain_backup_acks", note="the release queue: the unfetched tail goes back")


@story(
    "story-inv19-prefetch-splits-its-bounce-buffer",
    "INV-19",
    "a prefetch's bounce pages are freed, inserted or released, each exactly once",
    **STORAGE_WORLD,
)
def _inv19(r: Recorder) -> None:
    to_l3(r, pick=2)
    hit(r)
    run_storage(r, inv="INV-19", note="completed only grew; [0:completed] inserted, rest released")


@story(
    "story-inv20-three-ranks-same-collectives",
    "INV-20",
    "three ranks issue the same collectives in the same order",
    **{**STORAGE_WORLD, "storage_ranks": 3},
)
def _inv20(r: Recorder) -> None:
    to_l3(r, pick=1)
    r.apply("prefetch", {"pick": 0}, note="prefetch the chain")
    r.apply(
        "storage_step",
        {"kind": "hit_query"},
        inv="INV-20",
        note="the hit's MIN reduction on all three ranks",
    )
    r.apply("drain_prefetch_acks")
    run_storage(r, inv="INV-20", note="progress reductions matched rank by rank")


@story(
    "story-inv21-progress-is-the-min-over-ranks",
    "INV-21",
    "a short read on one rank holds every rank's published progress back",
    **STORAGE_WORLD,
)
def _inv21(r: Recorder) -> None:
    to_l3(r, pick=2)
    hit(r)
    r.apply(
        "inject_fault", {"fault": "short_read", "rank": 1, "pages": 1}, note="rank 1 reads short"
    )
    run_storage(r, inv="INV-21", note="every rank published the MIN of their progress")


@story(
    "story-inv22-no-verdict-before-the-hit",
    "INV-22",
    "the policy judges a prefetch only after its hit was published",
    **{**STORAGE_WORLD, "storage_policy": "wait_complete"},
)
def _inv22(r: Recorder) -> None:
    to_l3(r, pick=1)
    r.apply("prefetch", {"pick": 0}, note="prefetch the chain")
    rid = _driver(r).ongoing()[-1]
    r.apply("check_prefetch", {"request": rid}, inv="INV-22", note="no hit yet: 0 == 0 is not done")
    r.apply("storage_step", {"kind": "hit_query"})
    r.apply("drain_prefetch_acks")
    run_storage(r)
    if rid in _driver(r).ongoing():
        r.apply("check_prefetch", {"request": rid}, inv="INV-22", note="now every page landed")


@story(
    "story-inv23-terminate-while-io-writes",
    "INV-23",
    "a prefetch terminated mid-IO: its unfetched pages stay the IO's until the final ack",
    **STORAGE_WORLD,
)
def _inv23(r: Recorder) -> None:
    to_l3(r, pick=2)
    rid = hit(r)
    r.apply("storage_step", {"kind": "io"}, note="the IO fetched one page of three")
    r.apply(
        "terminate_prefetch",
        {"request": rid},
        inv="INV-23",
        note="an aborted request: nothing past the progress is freed yet",
    )
    run_storage(r, inv="INV-23", note="the tail goes back only after the final ack")


@story(
    "story-inv24-reset-with-releases-queued",
    "INV-24",
    "a reset with a prefetch's tail release still queued empties every storage queue",
    **{**STORAGE_WORLD, "storage_ranks": 1},
)
def _inv24(r: Recorder) -> None:
    to_l3(r, pick=2)
    rid = hit(r)
    r.apply("terminate_prefetch", {"request": rid}, note="terminated before any page landed")
    for _ in range(STEPS_MAX):
        if not (_runnable(r, StorageStepKind.IO) or _runnable(r, StorageStepKind.SYNC)):
            break
        for kind in ("io", "sync"):
            if _runnable(r, StorageStepKind(kind)):
                r.apply("storage_step", {"kind": kind})
    r.apply("drain_prefetch_acks", note="the final ack queues the whole buffer's release")
    r.apply(
        "reset_storage_in_flight",
        inv="INV-24",
        note="a new epoch: no queue keeps an old release, occupancy 0",
    )
    to_l3(r, pick=0)


@story(
    "story-inv25-a-raising-backend-still-acks-once",
    "INV-25",
    "a backend exception in a backup: still exactly one ack",
    **STORAGE_WORLD,
)
def _inv25(r: Recorder) -> None:
    r.apply("inject_fault", {"fault": "raise", "rank": 0, "pages": 1}, note="rank 0's set raises")
    r.apply("write_storage", {"pick": 1, "new": True}, note="a chain of two pages to L3")
    backup_steps(r)
    r.apply("drain_backup_acks", inv="INV-25", note="one ack per rank; host locks released")


@story(
    "story-inv26-failed-batch-acks-the-stored-prefix",
    "INV-26",
    "a backup whose first batch fails acks nothing stored",
    **STORAGE_WORLD,
)
def _inv26(r: Recorder) -> None:
    r.apply("inject_fault", {"fault": "set_fail", "rank": 1, "pages": 1}, note="rank 1's set fails")
    r.apply("write_storage", {"pick": 2, "new": True}, note="a chain of three pages to L3")
    backup_steps(r)
    r.apply("drain_backup_acks", inv="INV-26", note="rank 1's ack reports the stored prefix: 0")


@story(
    "story-inv27-keys-chain-from-the-parent",
    "INV-27",
    "a child chain's keys continue its parent's, never restart",
    **STORAGE_WORLD,
)
def _inv27(r: Recorder) -> None:
    to_l3(r, pick=0)  # a one-page parent under the root
    r.apply(
        "write_storage",
        {"pick": 2, "new": True},
        inv="INV-27",
        note="a three-page child under it: keys chained from the parent's last key",
    )
    backup_steps(r)
    r.apply("drain_backup_acks")
    hit(r, inv="INV-27", note="the child's keys are queried with its whole prefix")
    run_storage(r)


@story(
    "story-inv28-each-rank-writes-its-own-keys",
    "INV-28",
    "two ranks store the same chain under their own keys",
    **STORAGE_WORLD,
)
def _inv28(r: Recorder) -> None:
    to_l3(r, pick=1, inv="INV-28", note="one writer per key: the rank shard is in the key")
    hit(r)
    run_storage(r)


@story(
    "story-inv28-a-clear-stays-in-its-namespace",
    "INV-28",
    "rank 1 clears its backend at rest: rank 0's pages stay, the chain is backed up again",
    **STORAGE_WORLD,
)
def _inv28_clear(r: Recorder) -> None:
    to_l3(r, pick=1)
    r.apply("clear_storage", {"rank": 1}, inv="INV-28", note="rank 1's own two pages, no other")
    r.apply("write_storage", {"pick": 0, "new": False}, note="the chain again, for rank 1")
    backup_steps(r)
    r.apply("drain_backup_acks", note="whole on both ranks again")
    hit(r)
    run_storage(r)


@story(
    "story-inv29-a-miss-on-one-rank-shortens-every-hit",
    "INV-29",
    "one rank misses a page: the hit is the MIN over ranks, a legal endpoint",
    **STORAGE_WORLD,
)
def _inv29(r: Recorder) -> None:
    to_l3(r, pick=2)
    r.apply("inject_fault", {"fault": "exists_miss", "rank": 1, "pages": 1}, note="rank 1 misses")
    hit(r, inv="INV-29", note="every rank publishes the same, shorter hit")
    run_storage(r)


@story(
    "story-inv30-l3-pages-read-back-their-bytes",
    "INV-30",
    "a chain fetched from L3 and loaded to device holds the bytes written for its prefix",
    **STORAGE_WORLD,
)
def _inv30(r: Recorder) -> None:
    uid = to_l3(r, pick=1)
    hit(r)
    run_storage(r, inv="INV-30", note="every page read back equals what was written for its key")
    r.apply("load", {"node": uid}, note="the prefetched node to device")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-30", note="device bytes: the chain's own")


@story(
    "story-inv31-a-failed-batch-ends-the-backup",
    "INV-31",
    "a backup stops at its first failed batch: L3 stays prefix-closed",
    **{**STORAGE_WORLD, "storage_ranks": 1, "storage_faults": True},  # background faults too
)
def _inv31(r: Recorder) -> None:
    r.apply(
        "inject_fault", {"fault": "set_fail", "rank": 0, "pages": 1}, note="the first set fails"
    )
    r.apply("write_storage", {"pick": 2, "new": True}, note="a chain of three pages to L3")
    backup_steps(r, inv="INV-31", note="no page stored after a failed one")
    r.apply("drain_backup_acks", inv="INV-31")
