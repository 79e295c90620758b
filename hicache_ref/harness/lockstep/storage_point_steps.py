"""One storage step under schedule points in lockstep: each rank's thread granted from one point
to its next, as the oracle's ops (``before_point_step``, ``follow_point_step``).

In a world with ``storage_points`` a storage step grants every rank's thread of one kind that can
move (``harness/driver/storage_points.py``). Which rank's thread was granted, and at which point,
is the harness's own record: the gate's grant log and where the thread was parked before
(``schedule.points.position``). Each grant becomes the oracle's ops for the action at that point:

| point the thread left | oracle |
| --- | --- |
| ``wait`` | ``Advance`` (the ``get``; the IO's termination check too, which runs before it parks again, unless it is a ``lock`` point of its own) |
| ``batch_exists`` / ``batch_set`` | ``Advance`` with the call's outcome, read from what the backend answered |
| ``batch_get`` | the same, or ``defer`` when the thread parks at the call's ``return`` |
| ``return`` | a deferred ``batch_get``: its outcome now (the others were taken when they ran) |
| ``all_reduce`` | ``Collective`` of the group, once for every rank |
| ``put`` | ``Advance`` (the queue is the thread's, the IO's ack its kind and count) |
| ``page_write`` | ``Advance`` of the IO parked at ``land`` (page points: one page's bytes set) |
| ``lock`` | ``Advance`` of a termination check: the hit query's ``check``, the IO's ``check`` (before a batch) or ``recheck`` (before a page lands); the reference's, with lock points |

A rank whose thread the oracle says could move but was not granted (INV-20), a thread granted at
a point the oracle's thread is not at (the window it opens: an ack before its write INV-32, a
read after an observed termination INV-33, a write past a failed batch INV-31, ...), a thread of
an old epoch granted (INV-35), an IO ack of the wrong kind (INV-25) or count (past a hole INV-34,
else INV-19) diverge. Loop bodies that ended are compared as without points
(``storage_compare.compare_results``). At a reset, the bodies the stop ran to their end wrote
pages (``finish_stopped_bodies``): their ``batch_set`` calls are translated before ``Reset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.lockstep.storage_compare import THREAD_OF, compare_results
from hicache_ref.harness.lockstep.storage_follower import StorageFollower
from hicache_ref.harness.lockstep.storage_steps import (
    drop_lost,
    exists_outcome,
    get_outcome,
    set_outcome,
)
from hicache_ref.harness.schedule.gate import GrantRecord
from hicache_ref.harness.schedule.points import (
    ALL_REDUCE,
    BATCH_EXISTS,
    BATCH_GET,
    BATCH_SET,
    LOCK,
    PAGE_WRITE,
    PUT,
    RETURN,
    THREAD_KINDS,
    WAIT,
    Point,
    face,
    position,
)
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.oracle.storage import BACKUP, HIT_QUERY, IO, SYNC, Advance, Collective
from hicache_ref.oracle.storage.step import thread_ops

GROUP_OF = {HIT_QUERY: "hits", SYNC: "completion"}
CALL_OF = {BATCH_EXISTS: "exists", BATCH_GET: "get", BATCH_SET: "set"}
PUT_QUEUE = {
    HIT_QUERY: "prefetch_hit_queue",
    IO: "prefetch_sync_queue",
    SYNC: "ack_prefetch_queue",
    BACKUP: "ack_backup_queue",
}
"""The queue each thread's ``put`` point must name."""
ORACLE_POINTS = {
    (HIT_QUERY, BATCH_EXISTS): ("exists",),
    (IO, BATCH_GET): ("get",),
    (IO, PAGE_WRITE): ("land",),
    (HIT_QUERY, LOCK): ("check",),
    (IO, LOCK): ("check", "recheck"),
    (BACKUP, BATCH_SET): ("set",),
    (HIT_QUERY, PUT): ("publish",),
    (IO, PUT): ("progress", "final"),
    (SYNC, PUT): ("publish",),
    (BACKUP, PUT): ("ack",),
}
"""Where the oracle's thread must be parked when the implementation's leaves each point."""


@dataclass(frozen=True)
class PointsBefore:
    """What a point step's translation needs from before it ran, per rank."""

    at: tuple[Point | None, ...]  # where the kind's thread was parked
    last: tuple[GrantRecord | None, ...]  # the newest grant of the rank's gate
    movable: tuple[bool, ...]  # the oracle's thread could move


def _grants(tier: Any) -> list[GrantRecord]:
    grants: list[GrantRecord] = face(tier).gate.grants
    return grants


def _last_grant(tier: Any) -> GrantRecord | None:
    grants = _grants(tier)
    return grants[-1] if grants else None


def before_point_step(ls: StorageFollower, kind: StorageStepKind) -> PointsBefore:
    tiers = ls.driver.l3.tiers
    thread = THREAD_OF[kind]
    return PointsBefore(
        at=tuple(position(t, kind) for t in tiers),
        last=tuple(_last_grant(t) for t in tiers),
        movable=tuple(bool(thread_ops(ls.state, r, thread)) for r in range(len(tiers))),
    )


def follow_point_step(ls: StorageFollower, kind: StorageStepKind, before: PointsBefore) -> None:
    """Translate one point step (after it ran) and compare the bodies that ended."""
    tiers = ls.driver.l3.tiers
    thread = THREAD_OF[kind]
    what = f"{kind.value} point"
    granted: dict[int, tuple[GrantRecord, Point]] = {}
    for rank, tier in enumerate(tiers):
        grants = _grants(tier)
        point = before.at[rank]
        if grants and grants[-1] is not before.last[rank] and point is not None:
            granted[rank] = (grants[-1], point)
    for rank in range(len(tiers)):
        if before.movable[rank] and rank not in granted:
            raise ls.divergence(
                "INV-20", what, f"rank {rank}'s {kind.value} thread moved: oracle yes, "
                f"implementation no (parked at {_describe(before.at[rank])})",
            )  # fmt: skip
    reduced = False
    for rank, (record, point) in sorted(granted.items()):
        # Verify the granted thread is of the current epoch (INV-35: none of an old one runs)
        if record.thread_epoch != record.epoch:
            raise ls.divergence(
                "INV-35", what, f"rank {rank}'s {kind.value} thread of epoch "
                f"{record.thread_epoch} ran at {point.describe()} in epoch {record.epoch}: "
                "oracle no thread of an ended epoch, implementation one (stop and join every "
                "thread at reset)",
            )  # fmt: skip
        if point.kind == ALL_REDUCE:
            reduced = True
            continue
        after = position(tiers[rank], kind)
        _translate(ls, rank, thread, point, after, f"rank {rank} {what}")
        _no_extra_calls(ls, rank, thread, f"rank {rank} {what}")
    if reduced:
        ls.apply_op(Collective(GROUP_OF.get(thread, "?")), what)
        ls.collectives[GROUP_OF[thread]] += 1
    ls.steps += 1
    ls.session.stats.lockstep["storage_steps_in_lockstep"] += 1
    with ls.lock:
        results = dict(ls.results)
    compare_results(ls, kind, results, what)


def _describe(point: Point | None) -> str:
    return "nothing" if point is None else point.describe()


def _translate(
    ls: StorageFollower, rank: int, thread: int, point: Point, after: Point | None, what: str
) -> None:
    record = ls.state.ranks[rank].threads[thread]
    if point.kind == WAIT:
        # with lock points a look at termination is a point of its own, taken only while the
        # transfer is ok (a failed one skips the look: ``all_success and is_terminated()``)
        looks = ls.state.config.lock_points
        if thread == IO and record.point != "idle":  # the next batch: only the check
            if not (looks and record.ok):
                ls.apply_op(Advance(rank, IO), what)
            return
        ls.apply_op(Advance(rank, thread), what)  # the get on its input queue
        if thread == IO and ls.state.ranks[rank].threads[IO].point == "check" and not looks:
            ls.apply_op(Advance(rank, IO), what)  # its termination check, before it parks
        return
    if point.kind == RETURN:
        if thread == IO and record.pending:  # a deferred read returns: its outcome now
            ls.apply_op(get_outcome(ls, rank, record, _take(ls, rank, thread, "get"), True), what)
        return  # a deferred query or write was taken when it ran
    wanted = ORACLE_POINTS.get((thread, point.kind))
    if wanted is None or record.point not in wanted:
        raise _out_of_order(ls, rank, thread, record, point, what)
    if point.kind == BATCH_EXISTS:
        calls = _take(ls, rank, thread, "exists")
        ls.apply_op(exists_outcome(ls, rank, record, calls, True), what)
    elif point.kind == BATCH_GET:
        if after is not None and after.kind == RETURN:
            ls.apply_op(Advance(rank, IO, "defer"), what)  # its call is taken at the return
        else:
            calls = _take(ls, rank, thread, "get")
            ls.apply_op(get_outcome(ls, rank, record, calls, True), what)
    elif point.kind == BATCH_SET:
        calls = _take(ls, rank, thread, "set")
        ls.apply_op(set_outcome(ls, rank, list(calls)), what)
        drop_lost(ls, rank, calls)
    elif point.kind in (PAGE_WRITE, LOCK):
        ls.apply_op(Advance(rank, thread), what)  # a page's bytes set; a termination check
    else:
        if point.detail != PUT_QUEUE[thread]:
            raise ls.divergence(
                "INV-25", what, f"queue the {_name(thread)} thread puts on: oracle "
                f"{PUT_QUEUE[thread]}, implementation {point.detail}",
            )  # fmt: skip
        if thread == IO:
            _compare_io_ack(ls, rank, record, what)
        ls.apply_op(Advance(rank, thread), what)


def _compare_io_ack(ls: StorageFollower, rank: int, record: Any, what: str) -> None:
    """The ack the IO just put on ``prefetch_sync_queue`` against the oracle's: a final ack or
    progress, and the pages progress counts."""
    items = ls.driver.l3.tiers[rank].queues.prefetch_sync_queue.snapshot()
    if not items:
        return  # nothing to read (the queue is compared by length after the verb)
    ack = items[-1]
    final = bool(getattr(ack, "completed_req", False))
    if final != (record.point == "final"):
        raise ls.divergence(
            "INV-25", what, f"IO ack put: oracle {_ACK[record.point == 'final']}, "
            f"implementation {_ACK[final]} (exactly one final ack per prefetch, after its last "
            "batch)",
        )  # fmt: skip
    if final:
        return
    page = ls.driver.page
    got = int(getattr(ack, "completed_tokens", 0) or 0)
    want = record.value * page
    if got != want:
        view = ls.state.ranks[rank].prefetches[record.op]
        past_hole = view.first_hole >= 0 and got > view.first_hole * page
        raise ls.divergence(
            "INV-34" if past_hole else "INV-19", what, f"progress the IO acked (tokens): "
            f"oracle {want}, implementation {got}"
            + (f" (the first page it did not get is page {view.first_hole})" if past_hole else ""),
        )  # fmt: skip


_ACK = {True: "the final ack", False: "progress"}


def _out_of_order(
    ls: StorageFollower, rank: int, thread: int, record: Any, point: Point, what: str
) -> Exception:
    """A thread granted at a point the oracle's thread is not parked at: the window it opens."""
    inv_id = "INV-20"
    if (thread, point.kind, record.point) == (BACKUP, PUT, "set"):
        inv_id = "INV-32"  # the ack before the write of the pages it counts
    elif (thread, point.kind) == (IO, PUT) and record.point in ("land", "recheck"):
        inv_id = "INV-19"  # a progress ack before the bytes of a page it counts
    elif (thread, point.kind, record.point) == (SYNC, PUT, "reduce"):
        inv_id = "INV-21"  # progress published without the MIN over ranks
    elif (thread, point.kind) == (IO, PAGE_WRITE):
        inv_id = "INV-19"  # a page written that the oracle's IO does not land (after a cut)
    elif (thread, point.kind) == (IO, BATCH_GET):
        views = ls.state.ranks[rank].prefetches
        terminated = 0 <= record.op < len(views) and views[record.op].terminated
        inv_id = "INV-33" if record.seen_term or terminated else "INV-19"
    elif point.kind in CALL_OF:
        inv_id = {"exists": "INV-29", "get": "INV-19", "set": "INV-31"}[CALL_OF[point.kind]]
    elif point.kind == PUT:
        inv_id = "INV-25"
    return ls.divergence(
        inv_id, what, f"the {_name(thread)} thread left {point.describe()}: oracle parked at "
        f"{record.point} (op {record.op}, batch {record.batch}), implementation there",
    )  # fmt: skip


def _name(thread: int) -> str:
    return ("hit_query", "io", "sync", "backup")[thread]


def _own(call: BackendCall, thread: int) -> bool:
    return THREAD_KINDS.get(call.thread, "backup") == _name(thread)


def _take(ls: StorageFollower, rank: int, thread: int, kind: str) -> list[BackendCall]:
    """The oldest untranslated ``kind`` call of ``thread`` on ``rank`` (none: it raised)."""
    calls = ls.calls[rank]
    for index, call in enumerate(calls):
        if call.kind == kind and _own(call, thread):
            del calls[index]
            return [call]
    return []


def _no_extra_calls(ls: StorageFollower, rank: int, thread: int, what: str) -> None:
    """A grant makes at most the one call it was parked at (a deferred read waits for its
    return point)."""
    if ls.state.ranks[rank].threads[thread].pending:
        return
    extra = next((c for c in ls.calls[rank] if _own(c, thread)), None)
    if extra is not None:
        raise ls.divergence(
            {"exists": "INV-29", "get": "INV-19", "set": "INV-31"}.get(extra.kind, "INV-20"),
            what, f"backend calls: oracle none more, implementation batch_{extra.kind} of "
            f"{len(extra.keys)} keys",
        )  # fmt: skip


def finish_stopped_bodies(ls: StorageFollower) -> None:
    """Before ``Reset``: a backup the stop ran to its end wrote its batches (the harness's own
    record of its calls); the oracle's backup thread takes them, then every call is dropped."""
    for rank in range(ls.driver.n):
        while ls.state.ranks[rank].threads[BACKUP].point == "set":
            calls = _take(ls, rank, BACKUP, "set")
            if not calls:
                break
            ls.apply_op(set_outcome(ls, rank, list(calls)), f"rank {rank} backup stopped")
            drop_lost(ls, rank, calls)
    ls.calls = [[] for _ in range(ls.driver.n)]
