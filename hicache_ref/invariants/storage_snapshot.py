"""Plain data the storage checks read: the tiers as the harness sees them, and its own L3 model.

A ``StorageSnapshot`` is built by the harness after a storage step (or at quiescence) from
three sources, none of them the implementation's word about itself:

- what the implementation *emitted* on its queues, as the tree drained it (hit results,
  progress acks, backup acks), and the queue lengths and thread counts it exposes;
- what the harness's *own* objects saw: the rank group's collective log, the recording backend's
  calls (which keys were queried, stored, read, and what came back), the host pool's bytes;
- what the harness *expects*: its content oracle's bytes for every page of a token prefix.

Records, in the order a storage world produces them: ``CollectiveRecord`` -> ``PrefetchRecord``
(with ``BouncePageEvent`` and ``VerdictRecord``) -> ``BackupRecord`` -> ``L3Model`` (``KeyUse``,
``StoreRead``, ``ClearRecord``) -> ``TierView`` -> ``StorageSnapshot``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Prefix = tuple[int, ...]
"""The token ids of a whole-page prefix from the root (what a page key must commit to)."""


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank issued it, with what it gave and what it got back."""

    rank: int
    group: str
    seq: int  # this rank's index of the call on this group
    op: str  # "min", "max", "sum"
    contribution: tuple[int, ...]
    result: tuple[int, ...]
    step: int | None  # the lockstep step it was issued in (None: thread executor)


@dataclass(frozen=True)
class ProgressAck:
    """One ack the tree drained from ``ack_prefetch_queue`` on one rank, in drain order."""

    request_id: str
    completed_tokens: int | None
    completed_req: bool


@dataclass(frozen=True)
class BouncePageEvent:
    """The tree inserted or freed page ``page`` of a prefetch's bounce buffer."""

    request_id: str
    page: int  # index within the bounce buffer
    action: str  # "insert" | "free"
    published_tokens: int  # the progress the tree had drained off ack_prefetch_queue by then
    final_acked: bool  # whether the tree had drained the request's final ack by then


@dataclass(frozen=True)
class VerdictRecord:
    """The implementation said a prefetch is complete (or not), and what the harness knew."""

    request_id: str
    claimed_complete: bool
    hit_published: bool  # the tree had drained the request's hit result
    published_tokens: int  # the progress the tree had drained by then (not the op's own field)
    hit_tokens: int | None


@dataclass(frozen=True)
class PrefetchRecord:
    """The harness's record of one prefetch on one rank."""

    request_id: str
    epoch: int  # the harness's epoch (resets and attaches it drove) when it started
    tokens: int  # tokens queried
    local_hit_tokens: int | None  # this rank's leading run, as its backend answered
    published_hit_tokens: int | None  # the hit count the tree drained (None: not yet)
    hash_pages: int | None  # len(hash_value) when the tree drained the hit
    bounce_tokens: int | None  # the bounce buffer the tree allocated (None: none)
    published_progress: tuple[int, ...] = ()  # completed_tokens the tree applied, in order
    landed_pages: tuple[int, ...] = ()  # per applied value: leading pages with oracle bytes
    sidecar_pages: tuple[int, ...] = ()  # per applied value: leading pages whose sidecar
    # (draft) page holds the oracle's bytes too; empty outside a sidecar world (INV-37)
    cut_tokens: int | None = None  # host pressure: the tree served this much of the hit
    terminated_at: int | None = None  # what terminate_prefetch returned
    io_counted: tuple[tuple[int, int, int], ...] = ()  # IO acks as put: before, after, landed
    completed_now: int | None = None  # completed_tokens read at this snapshot
    final_acks: int = 0  # completed_req acks the tree drained
    settled: bool = False  # the tree inserted or gave back every page of the buffer
    retired: bool = False  # the tree is done with it (completed or terminated, then taken out)
    unreturned: tuple[int, ...] = ()  # bounce token indices neither inserted nor given back
    released: tuple[tuple[int, int, str], ...] = ()  # [start, end) and how it went back
    events: tuple[BouncePageEvent, ...] = ()
    verdicts: tuple[VerdictRecord, ...] = ()
    local_restorable: tuple[int, ...] | None = None
    """An SWA world: the prefix lengths (pages) whose trailing window this rank's backend found
    with their KV pages (``trailing_pages``; may have holes); None elsewhere (INV-29)."""


@dataclass(frozen=True)
class SideWindowRecord:
    """An SWA world's prefetch result as the tree judged it on one rank (INV-39): the hit the
    tree served, the window of the hit's trailing pages, what the controller said it read of
    it, and what the harness found at the window's slots, all from the harness's own records
    (its fill, its staging, the controller's queues, the backend's calls and faults)."""

    rank: int
    request_id: str
    epoch: int
    hit_pages: int  # the hit served (after a host-pressure cut)
    completed_pages: int  # KV pages the published progress counts
    staged_pages: int  # window pages the tree staged at the hit (before a cut)
    window_pages: int  # the trailing window of the served hit: min(staged window, hit_pages)
    released_pages: int  # staged pages the controller gave back (its SWA release queue)
    published_pages: int | None  # the SWA hit the controller published (None: none)
    landed: tuple[bool, ...]  # per kept window page, in order: the bytes filled for its prefix
    stored: bool  # L3 holds this rank's SWA page of every window page (the harness's model)
    read_faulted: bool  # a fault hit a read of a window page on this rank
    accepted: bool  # the tree kept the result (all-or-nothing verdict)
    terminated: bool = False  # the tree terminated the prefetch before judging it


@dataclass(frozen=True)
class BackupRecord:
    """The harness's record of one ``write_storage`` on one rank."""

    op_id: int
    epoch: int
    pages: int  # pages handed to write_storage
    stored_pages: int | None  # leading pages the backend accepted (None: not run yet)
    acks: int = 0
    acked_tokens: int | None = None
    skipped: bool = False  # this rank skips backups (MLA rank != 0): nothing may be stored
    state_stored: bool = False  # a skipped rank stored every page of its Mamba state (sharded)


@dataclass(frozen=True)
class KeyUse:
    """A content key the implementation used for a page whose token prefix the harness knows."""

    rank: int
    key: str
    prefix: Prefix
    how: str  # "stored" (a set of the page) | "queried" (an exists of it)


@dataclass(frozen=True)
class StoreWrite:
    """A page the shared store accepted: its namespaced key, the writer, its bytes' digest."""

    rank: int
    stored_key: str
    content_key: str
    digest: str


@dataclass(frozen=True)
class StoreRead:
    """A page read back through a rank's backend, and the digest of what came back."""

    rank: int
    content_key: str
    digest: str


@dataclass(frozen=True)
class ClearRecord:
    """A rank's ``clear()``: the namespaced keys it removed, and whose they were."""

    rank: int
    removed: tuple[tuple[str, int], ...]  # (stored key, writer rank)


@dataclass(frozen=True)
class L3Model:
    """What the harness knows of L3: keys and prefixes, writes, reads, and what it expects."""

    key_uses: tuple[KeyUse, ...] = ()
    writes: tuple[StoreWrite, ...] = ()
    reads: tuple[StoreRead, ...] = ()
    clears: tuple[ClearRecord, ...] = ()
    expected: tuple[tuple[int, str, str], ...] = ()  # (rank, content key, oracle digest)
    believed: tuple[tuple[int, str], ...] = ()  # (rank, content key) the harness thinks stored
    written: tuple[tuple[int, str], ...] = ()  # (rank, content key) a set reported stored
    present: tuple[tuple[int, str], ...] = ()  # (rank, content key) the store holds now
    lost: tuple[tuple[int, str], ...] = ()  # (rank, content key) dropped by an injected fault


@dataclass(frozen=True)
class TierView:
    """One rank's tier as it exposes itself: queue lengths, occupancy, live threads."""

    rank: int
    attached: bool
    queue_sizes: tuple[tuple[str, int], ...]
    prefetch_tokens_occupied: int
    threads_alive: int


@dataclass(frozen=True)
class StaleAct:
    """Something of an earlier epoch surfaced after a reset or re-attach."""

    rank: int
    what: str  # e.g. "ack_prefetch_queue entry", "io step"
    request_or_op: str
    op_epoch: int


@dataclass(frozen=True)
class AckedPageRead:
    """INV-32: a page an acked backup counts, read back from L3 when the tree drained the ack."""

    rank: int
    op_id: int
    content_key: str
    digest: str | None  # what the store returned (None: nothing)
    expected: str | None  # the oracle's digest of the page's prefix on this rank
    lost: bool  # dropped or evicted by an injected fault the harness knows of


@dataclass(frozen=True)
class LateRead:
    """INV-33: a backend read of a prefetch's pages that ran after the tree's
    ``terminate_prefetch`` for it returned (the harness's step clock)."""

    rank: int
    request_id: str
    keys: tuple[str, ...]
    in_flight: bool = False  # one read could still run: the IO was parked at its call when the
    # tree terminated, or had not read the prefetch yet (it looks after a batch, 0.5.10)


@dataclass(frozen=True)
class ReadHole:
    """INV-34: the first page of a prefetch whose read came back with nothing (a hole)."""

    rank: int
    request_id: str
    page: int


@dataclass(frozen=True)
class StaleGrant:
    """INV-35: a grant the harness gave a parked storage thread started in an earlier epoch."""

    rank: int
    thread: str
    thread_epoch: int
    epoch: int
    point: str


@dataclass(frozen=True)
class WindowEvidence:
    """What the harness recorded about the windows inside a storage thread's loop body."""

    acked_reads: tuple[AckedPageRead, ...] = ()
    late_reads: tuple[LateRead, ...] = ()
    holes: tuple[ReadHole, ...] = ()
    stale_grants: tuple[StaleGrant, ...] = ()


@dataclass(frozen=True)
class PpTicketRecord:
    """INV-38: one PP prefetch ticket as one PP rank's command thread took it off the command
    group's broadcast (a PP world, ``HarnessConfig.storage_pp``), in the rank's take order."""

    request_id: str
    epoch: int  # the harness's epoch (resets it drove) when the rank took it
    keys: tuple[str, ...]  # the page keys the rank's command thread queried for it
    hit_tokens: int | None  # the rank-agreed hit it staged (None: no state to stage it in)
    held_tokens: int = 0  # host slots the harness saw allocated for it and not yet freed
    ready: bool = False  # the rank's sync thread published its completion
    retired: bool = False  # the rank's tree released the request (release_pp_prefetch)
    ended: bool = True  # the rank's command thread ended its loop body for it (keys and hit
    # are final; under schedule points a body is judged in parts until then)
    shard_tokens: int | None = None  # 0.5.21 - 0.5.22 (the ticket carries PP rank 0's hit):
    # the leading run of the ticket's tokens this rank's shard held when PP rank 0 decided the
    # hit; None where every rank queries its own shard (0.5.23+)
    stray_writes: tuple[tuple[int, str], ...] = ()  # (host slot, its holder then: a ticket's
    # id, "write", or "free") of every page the rank's IO wrote for this ticket into a slot the
    # ticket did not hold at that moment (the host pool's page writes, watched; a window's
    # page: a slot of its side pool, the holder marked "(swa)" or "(mamba)")
    side_held_tokens: int = 0  # an independent side pool's slots (its own) the harness saw
    # allocated for the ticket's window and not yet freed nor given back on its release queue
    side_window_tokens: int = 0  # the window the ticket's spec names (its keys), in the side
    # pool's slots (a page of the KV's size for SWA, one slot for a Mamba state)
    side_pool: str = ""  # the window's pool ("swa", "mamba"; "" with none), for the messages


@dataclass(frozen=True)
class PpVerdictRecord:
    """INV-38: one poll of the timeout stop policy's verdict on a prefetch without a PP ticket
    (a cache-mode PP group), as every PP rank's ``_can_terminate_prefetch`` returned it."""

    request_id: str
    poll: int  # the prefetch's poll, from 1
    verdicts: tuple[bool, ...]  # per PP rank: terminate the prefetch now
    deadline_passed: bool  # the harness's clock model: PP rank 0's deadline passed, its KV
    # not all landed (the budget from the operation's start, or from its first blocked poll)
    clocks: tuple[float, ...] = ()  # each rank's elapsed time on its own clock, for the message


@dataclass(frozen=True)
class BeliefView:
    """One rank's storage existence beliefs in a ``buffer_only`` world (INV-41): what the
    tree's class holds for the KV pool, beside what the harness's record of the world allows."""

    rank: int
    believed: tuple[str, ...]  # the keys the class believes stored (sorted)
    inflight: tuple[tuple[str, int], ...]  # the class's in-flight refs (sorted)
    taught: tuple[str, ...]  # the harness's: an acked write or a rank-agreed hit taught each,
    # and no drained hit query found it missing since (sorted)
    launched: tuple[tuple[str, int], ...]  # the harness's: writes launched, not yet acked
    refuted: tuple[str, ...] = ()  # the harness's: found missing by a drained hit query, not
    # taught since (for the message)
    staged_tokens: int = 0  # the write staging the tree holds (freed at each storage ack)
    admission: tuple[bool, int, int, int] | None = None  # the controller's last prefetch
    # rate-limit verdict on this rank: (limited, host tokens in use, write staging, pool size)
    # then; None: none yet


@dataclass(frozen=True)
class StorageSnapshot:
    """Every rank's storage state, the harness's records and its L3 model, at one moment."""

    page_size: int
    world_size: int
    epoch: int
    tiers: tuple[TierView, ...]
    prefetches: tuple[tuple[PrefetchRecord, ...], ...]  # per rank
    backups: tuple[tuple[BackupRecord, ...], ...]  # per rank
    acks: tuple[tuple[ProgressAck, ...], ...]  # per rank, drain order
    collectives: tuple[tuple[CollectiveRecord, ...], ...]  # per rank, issue order
    l3: L3Model = field(default_factory=L3Model)
    stale: tuple[StaleAct, ...] = ()
    lockstep: bool = True  # manual lockstep steps (False: real threads still running)
    quiescent: bool = False  # every storage queue drained and no step runnable
    just_reset: bool = False  # taken right after a reset (INV-24)
    detached: bool = False  # taken right after a detach (INV-24)
    windows: WindowEvidence = field(default_factory=WindowEvidence)  # INV-32 .. INV-35
    pp_tickets: tuple[tuple[PpTicketRecord, ...], ...] = ()  # per PP rank (INV-38); () elsewhere
    pp_verdicts: tuple[PpVerdictRecord, ...] = ()  # the timeout verdicts since the last look
    pp_at_rest: bool = True  # every PP rank's command thread waits with no ticket for it, and
    # no IO or sync thread has work (under storage points a follower's may publish later)
    side_windows: tuple[SideWindowRecord, ...] = ()  # an SWA world's judged results (INV-39)
    beliefs: tuple[BeliefView, ...] = ()  # a buffer_only world's, per rank (INV-41); () elsewhere
