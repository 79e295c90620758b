"""The storage oracle's frozen state: per rank four threads, eight queues, L3, and per operation
what the tree and the threads have done with it.

Every record is a frozen dataclass over ints, bools and tuples, so a state is hashable (the
exhaustive checker keeps a visited set). Nothing here changes a state; ``threads``, ``tree`` and
``epochs`` return new ones (``evolve`` is the device oracle's fast ``replace``).

Content is abstract. An L3 page and a bounce page hold a *tag*: ``ABSENT`` (nothing, or not yet
landed), ``GOOD`` (the bytes the page's key stands for on that rank) or ``BAD`` (other bytes:
a write that read a source page after the tree had released it). A bounce page also has an
*owner*: its IO (``IO_OWNED``), the tree (``INSERTED``), the release queue (``RELEASING``) or
the host pool again (``FREED``).

Ghost fields (``first_hole``, ``seen_term``, ``stored``, ``aux``) record what the model itself
knows (where a read first missed, whether a thread saw the termination at its check, what the
backend accepted, what the collective agreed), so the checks never take an implementation's
word.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_ref.oracle.state import Violation, evolve, replace_at
from hicache_ref.oracle.storage.config import StorageConfig

ABSENT, GOOD, BAD = 0, 1, 2
"""Tags of an L3 page and of a bounce page's content."""
IO_OWNED, INSERTED, RELEASING, FREED = 0, 1, 2, 3
"""Owners of a bounce page."""

THREADS = ("hit_query", "io", "sync", "backup")
"""Each rank's storage threads (SGLang 0.5.23's T1..T4), by index."""
HIT_QUERY, IO, SYNC, BACKUP = 0, 1, 2, 3
GROUPS = ("hits", "completion")
"""The two collective groups: the hit query's MIN and the sync thread's progress MIN."""
GROUP_THREAD = {"hits": HIT_QUERY, "completion": SYNC}

FINAL = -1
"""The value of a final (``completed_req``) ack in a sync or ack queue entry."""


@dataclass(frozen=True, order=True)
class Thread:
    """One storage thread of one rank: the point it is parked at, and its locals.

    ``point`` names the action it takes when it next runs (``idle``: a ``get`` on its input
    queue; ``dead``: an exception ended it). ``op`` is the operation in hand, ``batch`` the next
    batch, ``value`` the running count (hit pages, completed pages, stored pages, an ack's
    value), ``aux`` a second number (the local run behind an agreed hit, the MIN a collective
    returned), ``ok`` the IO's ``all_success``, ``final`` a sync entry that is a final ack,
    ``pending`` a backend call issued and not yet returned, ``seen_term`` the termination the
    IO's last check saw, ``epoch`` the epoch the thread was started in; ``landing`` (page or lock
    points only) the pages the IO's read returned that it has still to land, in order, each
    with the tag its read returned (L3 may lose the page meanwhile; the read has its bytes).
    """

    point: str = "idle"
    op: int = -1
    batch: int = 0
    value: int = 0
    aux: int = 0
    ok: bool = True
    final: bool = False
    pending: bool = False
    seen_term: bool = False
    epoch: int = 1
    landing: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, order=True)
class PrefetchView:
    """One prefetch on one rank.

    ``current``: in the tree's ``ongoing_prefetch``; ``terminated``: ``mark_terminate`` ran;
    ``hit_local`` / ``hit``: the rank's leading run and the agreed hit (-1: not yet); ``bounce``
    / ``owner``: per bounce page its content tag and owner (``()``: no buffer); ``published``:
    progress the tree applied; ``local``: pages the rank's IO counted; ``first_hole``: the first
    page its IO asked for and did not get (-1: none); ``final_put`` / ``final_drained``: final
    acks the IO put and the tree drained.
    """

    issued: bool = False
    current: bool = False
    terminated: bool = False
    hit_local: int = -1
    hit: int = -1
    bounce: tuple[int, ...] = ()
    owner: tuple[int, ...] = ()
    published: int = 0
    local: int = 0
    first_hole: int = -1
    final_put: int = 0
    final_drained: int = 0


@dataclass(frozen=True, order=True)
class BackupView:
    """One backup on one rank: the source's host lock, what the backend accepted, its acks."""

    issued: bool = False
    source_held: bool = False
    stored: int = 0
    acks_put: int = 0
    acks_drained: int = 0


AckEntry = tuple[int, int]
"""``(op, value)``: a queue entry naming an operation and a page count (``FINAL``: final ack)."""


@dataclass(frozen=True, order=True)
class RankState:
    """One rank: its threads, its L3 namespace, its views of every operation, its queues
    (SGLang's names; ``release_queue`` is ``host_mem_release_queue``, entries ``(op, page)``)."""

    threads: tuple[Thread, ...]
    l3: tuple[int, ...]
    prefetches: tuple[PrefetchView, ...]
    backups: tuple[BackupView, ...]
    prefetch_queue: tuple[int, ...] = ()
    hit_queue: tuple[int, ...] = ()
    buffer: tuple[int, ...] = ()
    sync_queue: tuple[AckEntry, ...] = ()
    ack_queue: tuple[AckEntry, ...] = ()
    backup_queue: tuple[int, ...] = ()
    backup_acks: tuple[AckEntry, ...] = ()
    release_queue: tuple[AckEntry, ...] = ()

    def thread_queues_empty(self) -> bool:
        """No thread has input waiting."""
        return not (self.prefetch_queue or self.buffer or self.sync_queue or self.backup_queue)

    def control_queues_empty(self) -> bool:
        """Nothing waits for the tree."""
        return not (self.hit_queue or self.ack_queue or self.backup_acks or self.release_queue)


@dataclass(frozen=True)
class StorageState:
    """The whole storage model: one value per step.

    ``epoch`` counts attaches and resets; ``faults_left`` / ``resets_left`` are what the world's
    budgets still allow; ``lost`` the ``(rank, page)`` an injected fault removed from L3;
    ``fresh_epoch`` nothing happened since the last reset; ``faults`` the violations found while
    stepping (sticky; ``check_storage_invariants`` reports them).
    """

    config: StorageConfig
    ranks: tuple[RankState, ...]
    epoch: int = 1
    attached: bool = True
    faults_left: int = 0
    resets_left: int = 0
    lost: tuple[tuple[int, int], ...] = ()
    fresh_epoch: bool = False
    faults: tuple[Violation, ...] = ()

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.ranks,
                    self.epoch,
                    self.attached,
                    self.faults_left,
                    self.resets_left,
                    self.lost,
                    self.fresh_epoch,
                    self.faults,
                )
            )
            self.__dict__["_hash"] = cached
        return int(cached)


def fresh_rank(config: StorageConfig, rank: int, epoch: int, l3: tuple[int, ...]) -> RankState:
    """A rank at the start of an epoch: idle threads, empty queues, no operation issued."""
    count = len(config.ops)
    return RankState(
        threads=tuple(Thread(epoch=epoch) for _ in THREADS),
        l3=l3,
        prefetches=(PrefetchView(),) * count,
        backups=(BackupView(),) * count,
    )


def initial_storage_state(config: StorageConfig) -> StorageState:
    """Attached, epoch 1, every rank's L3 holding its ``preloaded`` leading pages."""
    ranks = tuple(
        fresh_rank(
            config,
            r,
            1,
            tuple(GOOD if p < config.preloaded_pages(r) else ABSENT for p in range(config.pages)),
        )
        for r in range(config.ranks)
    )
    return StorageState(
        config=config,
        ranks=ranks,
        faults_left=config.max_faults,
        resets_left=config.max_resets,
    )


def with_storage_fault(state: StorageState, inv_id: str, message: str) -> StorageState:
    """``state`` with one more fault recorded (kept sorted and unique)."""
    fault = Violation(inv_id, message)
    if fault in state.faults:
        return state
    return evolve(state, faults=tuple(sorted((*state.faults, fault))))


def with_rank(state: StorageState, rank: int, updated: RankState) -> StorageState:
    return evolve(state, ranks=replace_at(state.ranks, rank, updated))


def with_thread(rank_state: RankState, thread: int, updated: Thread) -> RankState:
    return evolve(rank_state, threads=replace_at(rank_state.threads, thread, updated))


def with_prefetch(rank_state: RankState, op: int, updated: PrefetchView) -> RankState:
    return evolve(rank_state, prefetches=replace_at(rank_state.prefetches, op, updated))


def with_backup(rank_state: RankState, op: int, updated: BackupView) -> RankState:
    return evolve(rank_state, backups=replace_at(rank_state.backups, op, updated))
