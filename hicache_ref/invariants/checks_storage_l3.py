"""Checkers of the backup half and of L3 itself (INV-25 .. INV-28, INV-30, INV-31).

Each takes a ``StorageSnapshot`` and raises ``InvariantViolation``. In the order a page meets
them on its way to L3 and back: one ack per operation (INV-25), the ack is the stored prefix and
nothing is believed stored that was not (INV-26), its key commits to its whole prefix (INV-27),
one rank writes it and ``clear`` stays in its namespace (INV-28), it reads back as the bytes
the harness's oracle expects (INV-30), and L3 holds no page without the pages before it
(INV-31).
"""

from __future__ import annotations

from collections import defaultdict

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import Prefix, StorageSnapshot


# -- INV-25 ---------------------------------------------------------------------------------------
@registered("INV-25", StorageSnapshot, storage=0)
def check_inv_25_one_ack(evidence: Evidence) -> None:
    """Exactly one ack per write_storage and one final ack per started transfer."""
    snapshot = storage_snapshot_of("INV-25", evidence)
    for rank, backups in enumerate(snapshot.backups):
        for backup in backups:
            # Verify at most one ack, and at quiescence exactly one (sglang#38427)
            if backup.acks > 1 or (snapshot.quiescent and backup.acks != 1):
                raise InvariantViolation(
                    "INV-25",
                    f"rank {rank} write_storage op {backup.op_id} was acked {backup.acks} times "
                    "(exactly one ack per write_storage, whatever the backend does)",
                )
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            started = record.bounce_tokens is not None
            if record.final_acks > 1 or (snapshot.quiescent and started and record.final_acks != 1):
                raise InvariantViolation(
                    "INV-25",
                    f"rank {rank} prefetch {record.request_id!r} got {record.final_acks} final "
                    "acks (exactly one completed_req ack per transfer, in a finally)",
                )


# -- INV-26 ---------------------------------------------------------------------------------------
@registered("INV-26", StorageSnapshot, storage=0)
def check_inv_26_ack_is_stored_prefix(evidence: Evidence) -> None:
    """A backup ack reports exactly the stored prefix; no page is believed stored unwritten."""
    snapshot = storage_snapshot_of("INV-26", evidence)
    page = snapshot.page_size
    for rank, backups in enumerate(snapshot.backups):
        for backup in backups:
            acked, stored = backup.acked_tokens, backup.stored_pages
            if acked is None:
                continue
            # a skipped rank stores no KV page; in a Mamba storage world it still stores its
            # rank-sharded state (upstream's should_backup keeps MAMBA on every rank) and acks
            # the span once every state page is stored
            expected = (backup.pages if backup.state_stored else 0) if backup.skipped else stored
            # Verify the ack is the stored prefix, in whole pages (sglang#39701)
            if expected is None or acked != expected * page or acked > backup.pages * page:
                raise InvariantViolation(
                    "INV-26",
                    f"rank {rank} write_storage op {backup.op_id} acked {acked} tokens but the "
                    f"backend stored the first {stored} of its {backup.pages} pages (the ack "
                    "reports the stored prefix and stops at the first failed batch)",
                )
    written = set(snapshot.l3.written)
    unwritten = sorted(set(snapshot.l3.believed) - written)
    # Verify every page the harness believes is in L3 was reported stored by a set
    if unwritten:
        rank, key = unwritten[0]
        raise InvariantViolation(
            "INV-26",
            f"rank {rank} believes page {key[:16]} is in L3 but no write stored it "
            f"({len(unwritten)} such pages; sglang#39444)",
        )


# -- INV-27 ---------------------------------------------------------------------------------------
@registered("INV-27", StorageSnapshot, storage=0)
def check_inv_27_prefix_keys(evidence: Evidence) -> None:
    """A page key stands for exactly one whole-page token prefix, and a prefix for one key."""
    snapshot = storage_snapshot_of("INV-27", evidence)
    page = snapshot.page_size
    prefix_of: dict[str, Prefix] = {}
    key_of: dict[Prefix, str] = {}
    for use in snapshot.l3.key_uses:
        if not use.prefix or len(use.prefix) % page:
            raise InvariantViolation(
                "INV-27",
                f"rank {use.rank} {use.how} key {use.key[:16]} for a prefix of "
                f"{len(use.prefix)} tokens (keys name whole pages from the root)",
            )
        known_prefix = prefix_of.setdefault(use.key, use.prefix)
        known_key = key_of.setdefault(use.prefix, use.key)
        # Verify the key depends on the whole prefix (sglang#35269) and write key = query key
        if known_prefix != use.prefix:
            raise InvariantViolation(
                "INV-27",
                f"key {use.key[:16]} ({use.how} on rank {use.rank}) names two prefixes that "
                f"end alike: {len(known_prefix)} and {len(use.prefix)} tokens, first differing "
                f"at token {_first_difference(known_prefix, use.prefix)} (chain page keys "
                "from the root, also for nodes made before attach)",
            )
        if known_key != use.key:
            raise InvariantViolation(
                "INV-27",
                f"one {len(use.prefix)}-token prefix has keys {known_key[:16]} and "
                f"{use.key[:16]} ({use.how} on rank {use.rank}; a stored and a queried page must hash alike)",
            )


def _first_difference(a: Prefix, b: Prefix) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


# -- INV-28 ---------------------------------------------------------------------------------------
@registered("INV-28", StorageSnapshot, storage=0)
def check_inv_28_key_namespace(evidence: Evidence) -> None:
    """One writer per stored key; a rank's clear() removes only its own keys."""
    snapshot = storage_snapshot_of("INV-28", evidence)
    writers: dict[str, set[int]] = defaultdict(set)
    for write in snapshot.l3.writes:
        writers[write.stored_key].add(write.rank)
    shared = {key: sorted(ranks) for key, ranks in writers.items() if len(ranks) > 1}
    # Verify no two ranks write one stored key (sglang#10969)
    if shared:
        key, ranks = next(iter(sorted(shared.items())))
        raise InvariantViolation(
            "INV-28",
            f"stored key {key[:40]} written by ranks {ranks} (keys carry the rank shard, so "
            "one writer per key)",
        )
    for clear in snapshot.l3.clears:
        foreign = [(key, writer) for key, writer in clear.removed if writer != clear.rank]
        # Verify clear() stays in the clearing rank's namespace (sglang#32693)
        if foreign:
            key, writer = foreign[0]
            raise InvariantViolation(
                "INV-28",
                f"rank {clear.rank}'s clear() removed {len(foreign)} pages of other ranks, e.g. "
                f"{key[:40]} of rank {writer} (clear only your own namespace)",
            )


# -- INV-30 ---------------------------------------------------------------------------------------
@registered("INV-30", StorageSnapshot, storage=0)
def check_inv_30_l3_bytes(evidence: Evidence) -> None:
    """Every page read back from L3 holds the bytes the oracle expects for its key."""
    snapshot = storage_snapshot_of("INV-30", evidence)
    expected = {(rank, key): digest for rank, key, digest in snapshot.l3.expected}
    for read in snapshot.l3.reads:
        want = expected.get((read.rank, read.content_key))
        # Verify a read returns what was written under that key, never another page's bytes
        if want != read.digest:
            what = "no page was written under it" if want is None else f"expected {want[:12]}"
            raise InvariantViolation(
                "INV-30",
                f"rank {read.rank} read key {read.content_key[:16]} back as {read.digest[:12]} "
                f"but {what} (a torn, foreign or misformatted page read as valid)",
            )


# -- INV-31 ---------------------------------------------------------------------------------------
@registered("INV-31", StorageSnapshot, storage=0)
def check_inv_31_prefix_closed(evidence: Evidence) -> None:
    """L3 holds no page of a chain without every page before it (or a page a fault lost)."""
    snapshot = storage_snapshot_of("INV-31", evidence)
    page = snapshot.page_size
    prefix_of = {use.key: use.prefix for use in snapshot.l3.key_uses}
    key_of = {use.prefix: use.key for use in snapshot.l3.key_uses}
    held = set(snapshot.l3.present) | set(snapshot.l3.lost)
    for rank, key in sorted(snapshot.l3.present):
        prefix = prefix_of.get(key)
        if prefix is None or len(prefix) <= page:
            continue
        parent = key_of.get(prefix[:-page])
        # Verify the page before it is in L3 too (sglang#26886)
        if parent is None or (rank, parent) not in held:
            raise InvariantViolation(
                "INV-31",
                f"rank {rank}: L3 holds page {len(prefix) // page - 1} (key {key[:16]}) of a "
                "chain but not the page before it (back up a chain prefix first, and stop a "
                "backup at its first failed batch)",
            )
