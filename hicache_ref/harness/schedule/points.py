"""Schedule points: where a storage thread parks, and what a backend call at one may return.

A storage thread (the reference's executor threads, upstream's own thread functions) runs on a
real thread and, in a world with ``storage_points``, parks at every point where another
thread's action can matter. The machine decides which parked thread runs to its next point
(``harness/rules/schedule.SCHEDULE_POINT``), and at a backend point also what the call returns. The
names below are what the trace, the oracle and ``specs/protocol.md`` ("Storage schedule
points") call them. In the order a loop body meets them:

- ``wait``: the loop's blocking wait for work (upstream's ``queue.get``; the reference's wait
  on its source queue, or on a transfer still in progress); a loop body starts after it;
- ``batch_exists`` / ``batch_get`` / ``batch_set``: one backend call (the ``_v1``/``_v2`` forms
  and the per-key ``exists``/``get``/``set`` reach the recording backend as these three), before
  it runs; ``return``: after a call whose completion was deferred, before the thread sees it;
- ``all_reduce``: one collective, before it is issued (granted on every rank at once);
- ``put``: one put on a control queue (an ack, a hit, a release), before the item is visible;
- ``lock``: one acquire of a lock on a storage path (an operation's ``_lock``: its
  ``is_terminated`` / ``mark_terminate`` / progress), before it is taken, so a termination by the
  tree lands right before the thread looks (upstream's in every world with points, the
  reference's in a world that also draws ``storage_lock_points``);
- ``event``: one ``set`` or ``wait`` of an event by a storage thread, before it acts;
- ``page_write``: one host page written from a storage read (the host pool's
  ``set_from_flat_data_page``), before its bytes are set, in a world that also draws
  ``storage_page_points``: a count or an ack that runs ahead of the page's bytes is seen by the
  tree before the bytes land (sglang#8901's class).

Outcomes of a backend call (``OUTCOMES``), drawn per call for any implementation: ``ok``;
``hole`` (one key of the batch fails: absent at a query, unreadable at a read, refused at a
write, from that key on); ``gone`` (the key's page is evicted just before the call: every later
read or query of it misses too); ``raise`` (the backend raises); ``short`` (a read fills half
of the page, then reports it unreadable; a write stores the keys before it and refuses it);
``defer`` (the call runs now but returns only at the thread's next grant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WAIT = "wait"
BATCH_EXISTS = "batch_exists"
BATCH_GET = "batch_get"
BATCH_SET = "batch_set"
RETURN = "return"
ALL_REDUCE = "all_reduce"
PUT = "put"
LOCK = "lock"
EVENT = "event"
PAGE_WRITE = "page_write"
POINT_KINDS = (
    WAIT, BATCH_EXISTS, BATCH_GET, BATCH_SET, RETURN, ALL_REDUCE, PUT, LOCK, EVENT, PAGE_WRITE,
)  # fmt: skip
BACKEND_POINTS = (BATCH_EXISTS, BATCH_GET, BATCH_SET)

OK = "ok"
HOLE = "hole"
GONE = "gone"
RAISE = "raise"
SHORT = "short"
DEFER = "defer"
OUTCOMES = (OK, HOLE, GONE, RAISE, SHORT, DEFER)
AT_MAX = 3
"""Which key of a batch a ``hole``/``gone``/``short`` hits: ``at % len(keys)``, ``at`` drawn in
``[0, AT_MAX]`` (batches are one to four pages in the machines)."""


@dataclass(frozen=True)
class Point:
    """Where one thread parks: the point's kind, what it names (a queue, the keys of a call, a
    collective's group), and for ``wait`` the queue it waits on."""

    kind: str
    detail: str = ""
    source: Any = None

    def describe(self) -> str:
        return f"{self.kind} {self.detail}".strip()


@dataclass(frozen=True)
class Grant:
    """What the machine hands a parked thread: run on, and the outcome of the call it is
    parked at (``ok`` for any other point); ``at`` picks the key an outcome hits."""

    outcome: str = OK
    at: int = 0


def schedule_point(kind: str, detail: str = "") -> Grant:
    """Park the calling thread at a point if it is a gated storage thread of a world with
    points (it has ``park_at_point``); any other thread (the tree's) passes at once. Code
    that must not import the harness (the reference's queues and rank group) does the same
    ``getattr`` itself."""
    import threading

    park = getattr(threading.current_thread(), "park_at_point", None)
    if park is None:
        return Grant()
    grant: Grant = park(kind, detail)
    return grant


THREAD_KINDS: dict[str, str] = {
    "prefetch_thread_func": "hit_query",
    "prefetch_io_aux_func": "io",
    "prefetch_sync_thread_func": "sync",
    "backup_thread_func": "backup",
    "hit_query": "hit_query",
    "io": "io",
    "sync": "sync",
    "backup": "backup",
}
"""A gated thread's function (upstream's thread function, or the reference's step kind) -> the
storage step kind it runs (``StorageStepKind`` values)."""


def face(tier: Any) -> Any:
    """What answers for a rank's threads: upstream's tier, or the reference's gated executor."""
    return tier if hasattr(tier, "position") else tier.executor


def position(tier: Any, kind: Any) -> Point | None:
    """Where ``tier``'s ``kind`` thread is parked now (None: not parked at a point)."""
    at = face(tier).position(kind)
    return None if at is None else at[1]
