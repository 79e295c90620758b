"""The storage oracle's operations: the tree's calls, the threads' schedule points, the faults
and the epochs. Frozen dataclasses, so a trace is a tuple that prints as runnable code.

A storage thread runs from one *schedule point* to the next (``Advance``): a ``get`` on its
input queue, a backend call (``batch_exists`` / ``batch_get`` / ``batch_set``, per batch), a
``put`` on its output queue, a termination check. At a backend call the op carries the call's
outcome. A collective is one joint point of every rank's thread of its group (``Collective``):
it runs once every rank's thread is parked at it, as an ``all_reduce`` returns only then.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prefetch:
    """The tree starts prefetch ``op`` on every rank (``prefetch_queue.put``)."""

    op: int


@dataclass(frozen=True)
class WriteStorage:
    """The tree backs up ``op``'s pages on every rank, holding their host lock until the ack."""

    op: int


@dataclass(frozen=True)
class DrainHits:
    """The tree drains ``prefetch_hit_queue`` (MIN length over ranks): each hit is revoked on
    every rank or given a bounce buffer of exactly the hit on every rank (``prefetch_buffer``).

    ``no_room`` (a harness's drain) names the ops whose buffer some rank's host pool could not
    hold: revoked like a miss. The exhaustive checker leaves it empty (host room is the tree's
    business, not the protocol's).
    """

    no_room: tuple[int, ...] = ()


@dataclass(frozen=True)
class DrainAcks:
    """The tree drains ``ack_prefetch_queue`` (MIN length over ranks): progress is applied to a
    current prefetch; a final ack inserts ``[0:published]`` of a current one and queues the
    rest of the buffer for release."""


@dataclass(frozen=True)
class DrainBackupAcks:
    """The tree drains ``ack_backup_queue``: each ack releases its source's host lock (the
    pages may be reused at once)."""


@dataclass(frozen=True)
class DrainReleases:
    """The tree frees every page on ``host_mem_release_queue`` into the host pool."""


@dataclass(frozen=True)
class Terminate:
    """``terminate_prefetch`` of ``op`` on every rank; the tree inserts ``[0:published]`` now
    and retires it (the rest is released at the final ack)."""

    op: int


@dataclass(frozen=True)
class Advance:
    """Thread ``thread`` (``state.THREADS`` index) of ``rank`` takes the action it is parked at
    and runs to its next point.

    ``outcome`` is drawn at a backend call: ``ok``; ``hole`` (page ``index`` of the batch is
    reported missing: a short read is a hole at the batch's last page); ``raise`` (the call
    raises); ``defer`` (the call is issued and returns at the thread's next ``Advance``, other
    threads running meanwhile); ``fail`` (``batch_set`` returns False, its first ``index``
    pages landed all the same: a partial batch). Every outcome but
    ``ok`` spends one of the world's ``max_faults``.
    """

    rank: int
    thread: int
    outcome: str = "ok"
    index: int = 0


@dataclass(frozen=True)
class Collective:
    """The ``all_reduce(MIN)`` of ``group`` (``hits`` or ``completion``) returns on every rank."""

    group: str


@dataclass(frozen=True)
class LosePage:
    """Rank ``rank``'s backend loses page ``page`` (present at a query, gone at the read)."""

    rank: int
    page: int


@dataclass(frozen=True)
class Reset:
    """``reset`` of every rank: threads stopped and joined, queues dropped, a new epoch."""


@dataclass(frozen=True)
class Detach:
    """``detach_storage_backend`` on every rank, once every operation reached its final ack:
    live prefetches are marked terminated, the threads stop."""


@dataclass(frozen=True)
class Attach:
    """``attach_storage_backend`` on every rank after a detach: a new epoch."""


@dataclass(frozen=True)
class Clear:
    """Rank ``rank``'s clear endpoint, at rest: its own namespace is emptied (INV-28)."""

    rank: int


StorageOp = (
    Prefetch
    | WriteStorage
    | DrainHits
    | DrainAcks
    | DrainBackupAcks
    | DrainReleases
    | Terminate
    | Advance
    | Collective
    | LosePage
    | Reset
    | Detach
    | Attach
    | Clear
)
