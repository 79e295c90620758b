"""The storage driver's records: what each prefetch and backup did, as the harness saw it.

``PrefetchLog`` and ``BackupLog`` are the mutable twins of the snapshot's frozen records
(``invariants/storage_snapshot.py``); ``StorageLog`` holds them per rank with the drained ack
streams, the L3 facts (key uses, writes, reads, expected digests) and the stale acts, and
``snapshot`` freezes all of it for the checkers. Nothing here asks the implementation: the
driver fills the logs from the tree's decisions, the recording backend and the host pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from hicache_ref.invariants.storage_snapshot import (
    AckedPageRead,
    BackupRecord,
    BouncePageEvent,
    ClearRecord,
    CollectiveRecord,
    KeyUse,
    L3Model,
    LateRead,
    PrefetchRecord,
    Prefix,
    ProgressAck,
    ReadHole,
    SideWindowRecord,
    StaleAct,
    StaleGrant,
    StorageSnapshot,
    StoreRead,
    StoreWrite,
    TierView,
    VerdictRecord,
    WindowEvidence,
)

LOG_RECORDS_MAX = 100_000
"""Bound on the records of one case (TigerStyle); a case this long is refused loudly."""
_UNSET = object()


class KeptRecord:
    """A log that keeps its last frozen record until a field the record copies is assigned a
    different value.

    Every field named in ``record_fields`` holds an immutable value (ints, strings, None,
    tuples of frozen records), so assignment is the only way it changes: the record a
    snapshot froze is the record a fresh freeze would build, and the next snapshot reuses it
    (a storage check freezes every log of the case, most of them unchanged since the last
    one). A field a log changes in place would go stale here; ``tests/harness/
    test_storage_log_records.py`` pins the field types."""

    record_fields: ClassVar[frozenset[str]] = frozenset()

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.record_fields and self.__dict__.get(name, _UNSET) != value:
            self.__dict__["_record"] = None  # the next freeze builds a new record
        object.__setattr__(self, name, value)

    def kept_record(self) -> object:
        """The last record frozen, or None when a copied field changed since."""
        return self.__dict__.get("_record")

    def keep_record(self, record: object) -> None:
        self.__dict__["_record"] = record


@dataclass
class PrefetchLog(KeptRecord):
    request_id: str
    epoch: int
    tokens: int
    anchor_prefix: Prefix
    chain_uid: int
    local_hit_tokens: int | None = None
    published_hit_tokens: int | None = None
    hash_pages: int | None = None
    cut_tokens: int | None = None  # the tree cut the hit to this for lack of host room
    bounce_tokens: int | None = None
    published_progress: tuple[int, ...] = ()
    landed_pages: tuple[int, ...] = ()
    sidecar_pages: tuple[int, ...] = ()
    """In a sidecar world, per published progress value: leading pages whose draft page holds
    the oracle's bytes too (INV-37)."""
    terminated_at: int | None = None
    landed_at_termination: int | None = None
    sidecar_at_termination: int | None = None  # its draft pages judged then too (INV-37)
    """Leading pages with the oracle's bytes when ``terminate_prefetch`` froze the progress:
    the tree owns ``[0:terminated_at)`` from then on and may free and reuse those pages before
    the IO's body ends, so they are judged then (INV-19)."""
    io_counted: tuple[tuple[int, int, int], ...] = ()
    """Under schedule points, each IO progress ack that counted more tokens than the last, as it
    became visible: ``(tokens before, tokens after, pages of that range with the oracle's
    bytes then)`` (INV-19; a count that runs ahead of a page write)."""
    completed_now: int | None = None
    final_acks: int = 0
    retired: bool = False
    released: tuple[tuple[int, int, str], ...] = ()
    events: tuple[BouncePageEvent, ...] = ()
    verdicts: tuple[VerdictRecord, ...] = ()
    owned_slots: dict[int, int] = field(default_factory=dict)  # bounce slot -> token index
    operation: object = None  # the prefetch the tree started (to read its progress)
    local_restorable: tuple[int, ...] | None = None  # an SWA world's restorable prefixes
    swa_trailing: int = 0  # the SWA window pages the prefetch named (0: none)
    swa_released: set[int] = field(default_factory=set)  # staged slots the controller released
    swa_staged: list[int] = field(default_factory=list)  # window slots the tree staged

    @property
    def published_tokens(self) -> int:
        """The progress the tree drained for this prefetch, never the operation's own field
        (an implementation that writes rank-local progress there must not vouch for it)."""
        return self.published_progress[-1] if self.published_progress else 0

    def freeze(self) -> PrefetchRecord:
        """The record of this prefetch now; the last one when nothing it copies changed (its
        two fields read from ``owned_slots``, a dict changed in place, are compared instead)."""
        settled = self.bounce_tokens is None or (
            self.retired and self.final_acks >= 1 and not self.owned_slots
        )
        unreturned = tuple(
            sorted(i for i in self.owned_slots.values() if i < (self.bounce_tokens or 0))
        )
        kept = self.kept_record()
        if (
            isinstance(kept, PrefetchRecord)
            and kept.settled == settled
            and kept.unreturned == unreturned
        ):
            return kept
        record = PrefetchRecord(
            request_id=self.request_id,
            epoch=self.epoch,
            tokens=self.tokens,
            local_hit_tokens=self.local_hit_tokens,
            published_hit_tokens=self.published_hit_tokens,
            hash_pages=self.hash_pages,
            cut_tokens=self.cut_tokens,
            bounce_tokens=self.bounce_tokens,
            published_progress=self.published_progress,
            landed_pages=self.landed_pages,
            sidecar_pages=self.sidecar_pages,
            terminated_at=self.terminated_at,
            io_counted=self.io_counted,
            completed_now=self.completed_now,
            final_acks=self.final_acks,
            settled=settled,
            retired=self.retired,
            unreturned=unreturned,
            released=self.released,
            events=self.events,
            verdicts=self.verdicts,
            local_restorable=self.local_restorable,
        )
        self.keep_record(record)
        return record


@dataclass
class BackupLog(KeptRecord):
    op_id: int
    epoch: int
    chain_uid: int
    pages: int
    skipped: bool
    stored_pages: int | None = None
    acks: int = 0
    acked_tokens: int | None = None
    state_stored: bool = False  # a skipped rank's Mamba state pages all stored (INV-26)

    def freeze(self) -> BackupRecord:
        """The record of this backup now; the last one when no field changed since."""
        kept = self.kept_record()
        if isinstance(kept, BackupRecord):
            return kept
        record = BackupRecord(
            op_id=self.op_id,
            epoch=self.epoch,
            pages=self.pages,
            stored_pages=self.stored_pages,
            acks=self.acks,
            acked_tokens=self.acked_tokens,
            skipped=self.skipped,
            state_stored=self.state_stored,
        )
        self.keep_record(record)
        return record


PrefetchLog.record_fields = frozenset(
    f.name for f in fields(PrefetchRecord) if f.name not in ("settled", "unreturned")
)
"""What a prefetch's record copies from its log (``settled`` and ``unreturned`` are computed
from ``owned_slots`` at every freeze)."""
BackupLog.record_fields = frozenset(f.name for f in fields(BackupRecord))


@dataclass
class StorageLog:
    """Every record of one storage world, per rank, since the last reset (L3 facts survive)."""

    ranks: int
    prefetches: list[dict[str, PrefetchLog]] = field(default_factory=list)
    backups: list[dict[int, BackupLog]] = field(default_factory=list)
    acks: list[list[ProgressAck]] = field(default_factory=list)
    key_uses: dict[tuple[int, str, Prefix, str], KeyUse] = field(default_factory=dict)
    writes: list[StoreWrite] = field(default_factory=list)
    reads: list[StoreRead] = field(default_factory=list)
    clears: list[ClearRecord] = field(default_factory=list)
    expected: dict[tuple[int, Prefix], str] = field(default_factory=dict)  # (rank, prefix)
    expected_sidecar: dict[tuple[int, Prefix], str] = field(default_factory=dict)  # draft page
    expected_swa: dict[tuple[int, Prefix], str] = field(default_factory=dict)  # SWA page
    side_windows: list[SideWindowRecord] = field(default_factory=list)  # INV-39
    written: set[tuple[int, str]] = field(default_factory=set)
    believed: set[tuple[int, str]] = field(default_factory=set)
    lost: set[tuple[int, str]] = field(default_factory=set)
    stale: list[StaleAct] = field(default_factory=list)
    collective_base: list[int] = field(default_factory=list)
    # kept by ``use_key`` (the snapshot read them from every key use, at every check)
    keyed: dict[tuple[int, Prefix], str] = field(default_factory=dict)  # latest key per prefix
    stored_keys: dict[tuple[int, str], None] = field(default_factory=dict)  # (rank, key) stored
    # the windows inside a loop body (INV-32 .. INV-34; ``storage_windows.py`` fills them)
    acked_reads: list[AckedPageRead] = field(default_factory=list)
    late_reads: list[LateRead] = field(default_factory=list)
    holes: list[ReadHole] = field(default_factory=list)
    terminated_step: dict[tuple[int, str], int] = field(default_factory=dict)
    in_flight: set[tuple[int, str]] = field(default_factory=set)  # one read may still run
    read_started: set[tuple[int, str]] = field(default_factory=set)  # the IO read its pages

    stale_slots: list[dict[int, tuple[str, int]]] = field(default_factory=list)
    """Per rank, bounce slots a prefetch of an ended epoch owned when the reset took them back:
    slot -> (request, epoch), until a current prefetch is given the slot again. A release of
    one while it is still free is that epoch's thread acting after the reset (INV-24)."""

    def __post_init__(self) -> None:
        self.stale_slots = [{} for _ in range(self.ranks)]
        self.forget_epoch([0] * self.ranks)

    def forget_epoch(self, collective_base: list[int]) -> None:
        """A reset: the operations and their acks are gone; what L3 holds stays."""
        for rank, logs in enumerate(self.prefetches):
            for log in logs.values():
                for slot in log.owned_slots:
                    self.stale_slots[rank][slot] = (log.request_id, log.epoch)
        self.prefetches = [{} for _ in range(self.ranks)]
        self.backups = [{} for _ in range(self.ranks)]
        self.acks = [[] for _ in range(self.ranks)]
        self.collective_base = list(collective_base)
        self.acked_reads, self.late_reads, self.holes = [], [], []
        self.terminated_step, self.in_flight, self.read_started = {}, set(), set()
        self.side_windows = []

    def use_key(self, use: KeyUse) -> None:
        if len(self.key_uses) >= LOG_RECORDS_MAX:
            raise OverflowError("the storage log holds too many key uses for one case")
        entry = (use.rank, use.key, use.prefix, use.how)
        if entry in self.key_uses:
            return
        self.key_uses[entry] = use
        self.keyed[(use.rank, use.prefix)] = use.key
        if use.how == "stored":
            self.stored_keys[(use.rank, use.key)] = None

    def record_clear(self, rank: int, removed: set[tuple[int, str]]) -> None:
        """Rank ``rank``'s clear removed these (writer rank, content key) pages (INV-28)."""
        stored = {(w.rank, w.content_key): w.stored_key for w in self.writes}
        pages = sorted((stored.get((writer, key), key), writer) for writer, key in removed)
        self.clears.append(ClearRecord(rank, tuple(pages)))

    def forget_namespace(self, ranks: set[int]) -> None:
        """A clear: the L3 model holds nothing of these ranks' namespace any more. No page
        under it is expected (a read before it is written again is caught, INV-30) or believed
        (INV-26). What a fault dropped stays ``lost``: a rewrite of it may be dropped again, and
        one a reset's stopping threads make goes unobserved (INV-31)."""
        self.expected = {k: v for k, v in self.expected.items() if k[0] not in ranks}
        self.expected_sidecar = {
            k: v for k, v in self.expected_sidecar.items() if k[0] not in ranks
        }
        self.expected_swa = {k: v for k, v in self.expected_swa.items() if k[0] not in ranks}
        self.believed = {k for k in self.believed if k[0] not in ranks}
        self.reads = [r for r in self.reads if r.rank not in ranks]  # checked when they were made

    def key_of(self, prefix: Prefix) -> str | None:
        for use in self.key_uses.values():
            if use.prefix == prefix:
                return use.key
        return None

    def l3(self, present: set[tuple[int, str]]) -> L3Model:
        keyed = self.keyed
        expected = tuple(
            (rank, keyed[(rank, prefix)], digest)
            for (rank, prefix), digest in sorted(self.expected.items())
            if (rank, prefix) in keyed
        )
        return L3Model(
            key_uses=tuple(self.key_uses.values()),
            writes=tuple(self.writes),
            reads=tuple(self.reads),
            clears=tuple(self.clears),
            expected=expected,
            believed=tuple(sorted(self.believed)),
            written=tuple(sorted(self.written)),
            present=tuple(sorted(present)),
            lost=tuple(sorted(self.lost)),
        )

    def snapshot(
        self,
        *,
        page_size: int,
        epoch: int,
        tiers: tuple[TierView, ...],
        collectives: tuple[tuple[CollectiveRecord, ...], ...],
        present: set[tuple[int, str]],
        quiescent: bool = False,
        just_reset: bool = False,
        detached: bool = False,
        stale_grants: tuple[StaleGrant, ...] = (),
    ) -> StorageSnapshot:
        return StorageSnapshot(
            page_size=page_size,
            world_size=self.ranks,
            epoch=epoch,
            tiers=tiers,
            prefetches=tuple(tuple(p.freeze() for p in rank.values()) for rank in self.prefetches),
            backups=tuple(tuple(b.freeze() for b in rank.values()) for rank in self.backups),
            acks=tuple(tuple(a) for a in self.acks),
            collectives=tuple(
                tuple(log[base:])
                for log, base in zip(collectives, self.collective_base, strict=True)
            ),
            l3=self.l3(present),
            stale=tuple(self.stale),
            lockstep=True,
            quiescent=quiescent,
            just_reset=just_reset,
            detached=detached,
            windows=WindowEvidence(
                tuple(self.acked_reads), tuple(self.late_reads), tuple(self.holes), stale_grants
            ),
            side_windows=tuple(self.side_windows),
        )
