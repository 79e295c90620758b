"""Checkers of the windows inside a storage thread's loop body (INV-32 .. INV-35).

Schedule points (``harness/schedule/``) let another thread act between two calls of one loop
body; these checks name what must still hold there. Each takes a ``StorageSnapshot`` whose
``windows`` the harness recorded itself (what the store returned when the tree drained an ack,
the backend calls its recording layer saw, the grants its gate gave), never what the
implementation says of itself. In the order a prefetch and a backup meet them:

- INV-32: every page an acked backup counts is readable from L3, byte-equal, when the tree
  drains the ack (an ack put before its write lets the tree free the pages first);
- INV-33: no backend read of a prefetch runs after its termination returned, one already in
  flight aside (an IO loop that does not look at termination between batches);
- INV-34: published progress never counts a page at or past the first page whose read came back
  empty (a ``continue`` past a hole);
- INV-35: no storage thread of an earlier epoch is granted again after a reset or detach (an old
  thread parked inside its loop body that a reset left behind).
"""

from __future__ import annotations

from collections import Counter

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import StorageSnapshot

IN_FLIGHT_READS = 1
"""Reads of a terminated prefetch that may still run: the one whose thread was parked at its
call when the tree terminated it (its termination check had already passed), or the first read
of a transfer that had not read yet (an IO that looks at termination after each batch, as
0.5.10's does, sees it only then)."""


# -- INV-32 ---------------------------------------------------------------------------------------
@registered("INV-32", StorageSnapshot, storage=0)
def check_inv_32_acked_pages_readable(evidence: Evidence) -> None:
    """Every page an acked backup counts reads back from L3 with the oracle's bytes at the drain."""
    snapshot = storage_snapshot_of("INV-32", evidence)
    for read in snapshot.windows.acked_reads:
        if read.lost:
            continue  # dropped or evicted by a fault the harness injected
        # Verify the ack vouches only for pages L3 already holds, byte-equal (sglang#39701)
        if read.digest is None or read.digest != read.expected:
            got = "nothing" if read.digest is None else f"bytes {read.digest}"
            raise InvariantViolation(
                "INV-32",
                f"rank {read.rank} backup op {read.op_id} was acked with page {read.content_key} "
                f"counted, but L3 returned {got} for it when the tree drained the ack (expected "
                f"{read.expected}): put the ack only after the pages it counts were written",
            )


# -- INV-33 ---------------------------------------------------------------------------------------
@registered("INV-33", StorageSnapshot, storage=0)
def check_inv_33_no_read_after_termination(evidence: Evidence) -> None:
    """No read of a prefetch runs after its termination returned, but the one in flight."""
    snapshot = storage_snapshot_of("INV-33", evidence)
    late = Counter((r.rank, r.request_id) for r in snapshot.windows.late_reads)
    excused = Counter((r.rank, r.request_id) for r in snapshot.windows.late_reads if r.in_flight)
    for (rank, request_id), count in sorted(late.items()):
        allowed = min(excused[(rank, request_id)], IN_FLIGHT_READS)
        # Verify the IO looks at termination before each batch (sglang#16747, #31296)
        if count > allowed:
            raise InvariantViolation(
                "INV-33",
                f"rank {rank} prefetch {request_id!r}: {count} backend read(s) ran after "
                f"terminate_prefetch returned ({allowed} was already in flight): check "
                "is_terminated() before every batch's read",
            )


# -- INV-34 ---------------------------------------------------------------------------------------
@registered("INV-34", StorageSnapshot, storage=0)
def check_inv_34_no_progress_past_a_hole(evidence: Evidence) -> None:
    """Published progress stops at the first page whose read came back empty."""
    snapshot = storage_snapshot_of("INV-34", evidence)
    page = snapshot.page_size
    holes: dict[tuple[int, str], int] = {}
    for hole in snapshot.windows.holes:
        key = (hole.rank, hole.request_id)
        holes[key] = min(holes.get(key, hole.page), hole.page)
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            first = holes.get((rank, record.request_id))
            if first is None:
                continue
            counted = max(record.published_progress, default=0)
            # Verify no page at or past the hole is counted (LMCache #2966's class)
            if counted > first * page:
                raise InvariantViolation(
                    "INV-34",
                    f"rank {rank} prefetch {record.request_id!r}: progress {counted} counts "
                    f"past page {first}, whose read came back empty (a run of fetched pages "
                    "ends at its first hole: stop counting there)",
                )


# -- INV-35 ---------------------------------------------------------------------------------------
@registered("INV-35", StorageSnapshot, storage=0)
def check_inv_35_no_old_epoch_thread(evidence: Evidence) -> None:
    """No grant ever goes to a storage thread started in an earlier epoch."""
    snapshot = storage_snapshot_of("INV-35", evidence)
    for grant in snapshot.windows.stale_grants:
        # Verify reset and detach left no parked thread of the old epoch (sglang#36882)
        if grant.thread_epoch < grant.epoch:
            raise InvariantViolation(
                "INV-35",
                f"rank {grant.rank}: storage thread {grant.thread} of epoch "
                f"{grant.thread_epoch} ran again in epoch {grant.epoch} (parked at "
                f"{grant.point or 'its wait'}): reset and detach must stop and join every "
                "storage thread, including one parked inside its loop body",
            )
