"""Checkers of the prefetch half of the storage tier (INV-19 .. INV-24, INV-29, INV-37).

Each takes a ``StorageSnapshot`` (``storage_snapshot.py``) and raises ``InvariantViolation``
naming the id, the rank, the request and what would have been right. In the order a prefetch
meets them: its hit is an endpoint every rank can serve (INV-29); every rank issues the same
collectives (INV-20) and publishes the MIN over ranks (INV-21); no verdict "complete" before the
hit (INV-22); progress only grows over landed pages and its buffer splits once (INV-19); the IO
owns the unpublished pages until the final ack (INV-23); nothing of an old epoch survives a
reset (INV-24); in a world with a sidecar pool, progress counts a page only with its sidecar's
bytes (INV-37).
"""

from __future__ import annotations

from collections import defaultdict

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.checks_prefetch import check_prefetch_progress
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import (
    CollectiveRecord,
    PrefetchRecord,
    StorageSnapshot,
)

COMPLETION_GROUP = "prefetch_completion"


def _reduce(op: str, values: list[tuple[int, ...]]) -> tuple[int, ...]:
    columns = list(zip(*values, strict=True))
    if op == "min":
        return tuple(min(c) for c in columns)
    if op == "max":
        return tuple(max(c) for c in columns)
    return tuple(sum(c) for c in columns)


def _by_group(log: tuple[CollectiveRecord, ...]) -> dict[str, list[CollectiveRecord]]:
    groups: dict[str, list[CollectiveRecord]] = defaultdict(list)
    for record in log:
        groups[record.group].append(record)
    return groups


# -- INV-19 ---------------------------------------------------------------------------------------
def _check_ranges(record: PrefetchRecord, page_size: int, rank: int) -> None:
    total = record.bounce_tokens or 0
    cursor = 0
    for start, end, how in sorted(record.released):
        # Verify each range is whole pages inside the buffer and starts after the last one
        if start % page_size or end % page_size or not 0 <= start <= end <= total:
            raise InvariantViolation(
                "INV-19",
                f"rank {rank} prefetch {record.request_id!r}: {how} range [{start}:{end}) is not "
                f"whole pages inside its {total}-token bounce buffer",
            )
        if start < cursor:
            raise InvariantViolation(
                "INV-19",
                f"rank {rank} prefetch {record.request_id!r}: bounce tokens [{start}:{cursor}) "
                f"given back twice (last by {how}); each page goes back exactly once",
            )
        if record.settled and start > cursor:
            raise InvariantViolation(
                "INV-19",
                f"rank {rank} prefetch {record.request_id!r}: bounce tokens [{cursor}:{start}) "
                "never inserted or released (a leak)",
            )
        cursor = max(cursor, end)
    if record.settled and cursor != total:
        raise InvariantViolation(
            "INV-19",
            f"rank {rank} prefetch {record.request_id!r}: its ranges end at {cursor} but the "
            f"bounce buffer has {total} tokens (inserted, freed and released ranges tile it)",
        )


@registered("INV-19", StorageSnapshot, storage=0)
def check_inv_19_prefetch_ranges(evidence: Evidence) -> None:
    """Progress grows in landed whole pages, freezes at termination; the buffer splits once."""
    snapshot = storage_snapshot_of("INV-19", evidence)
    page = snapshot.page_size
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            before = 0
            for after, landed in zip(record.published_progress, record.landed_pages, strict=True):
                try:
                    check_prefetch_progress(before, after, page, landed, terminated=False)
                except InvariantViolation as exc:
                    raise InvariantViolation(
                        "INV-19", f"rank {rank} prefetch {record.request_id!r}: {exc.detail}"
                    ) from None
                before = after
            # Verify every page an IO ack newly counts had its bytes when the ack was put
            for start, end, landed in record.io_counted:
                if landed * page < end - start:
                    raise InvariantViolation(
                        "INV-19",
                        f"rank {rank} prefetch {record.request_id!r}: the IO's progress ack "
                        f"counted tokens [{start}:{end}) when it was put, but only {landed} of "
                        f"those {(end - start) // page} page(s) had their bytes then (set a "
                        "page's bytes before an ack counts it; sglang#8901)",
                    )
            frozen, now = record.terminated_at, record.completed_now
            # Verify termination returned a page boundary and progress stayed there
            if frozen is not None and (frozen % page or (now is not None and now != frozen)):
                raise InvariantViolation(
                    "INV-19",
                    f"rank {rank} prefetch {record.request_id!r}: terminate_prefetch returned "
                    f"{frozen}, completed_tokens is now {now} (a page multiple that never "
                    "changes once terminate_prefetch returned)",
                )
            _check_ranges(record, page, rank)
            # Verify a retired prefetch gave back its buffer once every queue has drained
            if (
                snapshot.quiescent
                and record.epoch == snapshot.epoch
                and record.retired
                and record.final_acks >= 1
                and record.unreturned
            ):
                raise InvariantViolation(
                    "INV-19",
                    f"rank {rank} prefetch {record.request_id!r}: retired with bounce tokens "
                    f"{list(record.unreturned)} neither inserted nor released after every "
                    "storage queue drained (a leak: each bounce page goes back exactly once)",
                )


# -- INV-20 ---------------------------------------------------------------------------------------
@registered("INV-20", StorageSnapshot, storage=0)
def check_inv_20_storage_collectives(evidence: Evidence) -> None:
    """Every rank issues the same collectives, in the same order, with consistent results."""
    snapshot = storage_snapshot_of("INV-20", evidence)
    logs = [_by_group(log) for log in snapshot.collectives]
    if len(logs) < 2:
        return
    names = sorted({name for log in logs for name in log})
    for name in names:
        per_rank = [log.get(name, []) for log in logs]
        lengths = [len(calls) for calls in per_rank]
        # Verify no rank issued more collectives of a group than another (a hang in real TP)
        if (snapshot.lockstep or snapshot.quiescent) and len(set(lengths)) > 1:
            raise InvariantViolation(
                "INV-20",
                f"group {name}: ranks issued {lengths} collectives (every rank issues the same "
                "collectives, in the same order; sglang#30760)",
            )
        for seq in range(min(lengths)):
            calls = [calls[seq] for calls in per_rank]
            ops = {call.op for call in calls}
            results = {call.result for call in calls}
            expected = _reduce(calls[0].op, [call.contribution for call in calls])
            # Verify the k-th collective is the same op on every rank and reduces correctly
            if len(ops) > 1 or results != {expected}:
                raise InvariantViolation(
                    "INV-20",
                    f"group {name} collective #{seq}: ops {sorted(ops)}, results "
                    f"{sorted(results)} for contributions {[c.contribution for c in calls]} "
                    f"(expected one op and the result {expected} on every rank)",
                )


# -- INV-21 ---------------------------------------------------------------------------------------
@registered("INV-21", StorageSnapshot, storage=0)
def check_inv_21_min_progress(evidence: Evidence) -> None:
    """Every rank publishes the same acks, each progress the MIN of the ranks' progress."""
    snapshot = storage_snapshot_of("INV-21", evidence)
    streams = [
        [(a.request_id, a.completed_tokens, a.completed_req) for a in s] for s in snapshot.acks
    ]
    shortest = min((len(s) for s in streams), default=0)
    for index in range(shortest):
        seen = {stream[index] for stream in streams}
        # Verify the index-th published ack is the same on every rank
        if len(seen) > 1:
            raise InvariantViolation(
                "INV-21",
                f"published prefetch ack #{index} differs across ranks: {sorted(seen, key=str)} "
                "(publish only rank-reduced progress; sglang#27010)",
            )
    if snapshot.world_size < 2:
        return
    # a progress reduce has one value; 0.5.19+'s hybrid controller also reduces a pool-hit
    # vector (one value per pool name) on the same group after a sidecar read
    completions = [
        [c for c in _by_group(log).get(COMPLETION_GROUP, []) if len(c.contribution) == 1]
        for log in snapshot.collectives
    ]
    for rank, stream in enumerate(snapshot.acks):
        numeric = [a for a in stream if a.completed_tokens is not None]
        for k, ack in enumerate(numeric):
            contributions = [calls[k].contribution[0] for calls in completions if k < len(calls)]
            # Verify the k-th published progress is the MIN over every rank's k-th contribution
            if len(contributions) < snapshot.world_size or ack.completed_tokens != min(
                contributions
            ):
                raise InvariantViolation(
                    "INV-21",
                    f"rank {rank} published progress {ack.completed_tokens} for "
                    f"{ack.request_id!r} (ack #{k}) but the ranks' progress was "
                    f"{contributions} (publish the MIN over all ranks, never a rank's own)",
                )


# -- INV-22 ---------------------------------------------------------------------------------------
@registered("INV-22", StorageSnapshot, storage=0)
def check_inv_22_verdict_after_hit(evidence: Evidence) -> None:
    """No prefetch is judged complete before its hit result was published and met."""
    snapshot = storage_snapshot_of("INV-22", evidence)
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            for verdict in record.verdicts:
                if not verdict.claimed_complete:
                    continue
                hit = verdict.hit_tokens
                # Verify "complete" only after the hit result, and only once progress reached it
                if not verdict.hit_published or hit is None or verdict.published_tokens < hit:
                    raise InvariantViolation(
                        "INV-22",
                        f"rank {rank} prefetch {record.request_id!r} judged complete with hit "
                        f"{'unpublished' if not verdict.hit_published else hit} and "
                        f"{verdict.published_tokens} tokens published (0 == 0 is no completion; "
                        "sglang#9397)",
                    )


# -- INV-23 ---------------------------------------------------------------------------------------
@registered("INV-23", StorageSnapshot, storage=0)
def check_inv_23_io_owned_pages(evidence: Evidence) -> None:
    """No bounce page is freed or inserted while an IO may still write it."""
    snapshot = storage_snapshot_of("INV-23", evidence)
    page = snapshot.page_size
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            for event in record.events:
                start = event.page * page
                if event.action == "insert" and start >= event.published_tokens:
                    raise InvariantViolation(
                        "INV-23",
                        f"rank {rank} prefetch {record.request_id!r}: inserted bounce page "
                        f"{event.page} with only {event.published_tokens} tokens published "
                        "(insert [0:completed] of rank-reduced progress only)",
                    )
                # Verify an unpublished page goes back only after the request's final ack
                if start >= event.published_tokens and not event.final_acked:
                    raise InvariantViolation(
                        "INV-23",
                        f"rank {rank} prefetch {record.request_id!r}: bounce page {event.page} "
                        f"{event.action}d before the final ack while only "
                        f"{event.published_tokens} tokens were published (the IO may still "
                        "write it; sglang#27550)",
                    )


# -- INV-24 ---------------------------------------------------------------------------------------
@registered("INV-24", StorageSnapshot, storage=0)
def check_inv_24_storage_epochs(evidence: Evidence) -> None:
    """After a reset nothing old acts and nothing is queued; after a detach no thread lives."""
    snapshot = storage_snapshot_of("INV-24", evidence)
    # Verify nothing of an earlier epoch surfaced (sglang#36882)
    if snapshot.stale:
        act = snapshot.stale[0]
        raise InvariantViolation(
            "INV-24",
            f"rank {act.rank}: {act.what} of {act.request_or_op} from epoch {act.op_epoch} "
            f"after the harness moved to epoch {snapshot.epoch} (a reset drops every op and "
            "joins every storage thread)",
        )
    for tier in snapshot.tiers:
        queued = {name: n for name, n in tier.queue_sizes if n}
        if snapshot.just_reset and (queued or tier.prefetch_tokens_occupied):
            raise InvariantViolation(
                "INV-24",
                f"rank {tier.rank} after reset: queues {queued}, prefetch_tokens_occupied="
                f"{tier.prefetch_tokens_occupied} (a reset empties every storage queue and "
                "zeroes the occupancy; sglang#26009)",
            )
        if snapshot.detached and (tier.threads_alive or tier.attached):
            raise InvariantViolation(
                "INV-24",
                f"rank {tier.rank} after detach: {tier.threads_alive} storage threads alive, "
                f"attached={tier.attached} (detach stops and joins every storage thread)",
            )


# -- INV-29 ---------------------------------------------------------------------------------------
@registered("INV-29", StorageSnapshot, storage=0)
def check_inv_29_hit_endpoint(evidence: Evidence) -> None:
    """A published hit is whole pages, the MIN of the ranks' runs, and its buffer covers it."""
    snapshot = storage_snapshot_of("INV-29", evidence)
    page = snapshot.page_size
    by_request: dict[str, list[tuple[int, PrefetchRecord]]] = defaultdict(list)
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            by_request[f"{record.epoch}:{record.request_id}"].append((rank, record))
    for ranked in by_request.values():
        published = [(r, rec.published_hit_tokens) for r, rec in ranked]
        hits = {hit for _, hit in published if hit is not None}
        if not hits:
            continue
        local = [rec.local_hit_tokens for _, rec in ranked]
        request = ranked[0][1].request_id
        hit = next(iter(hits))
        full = len(ranked) == snapshot.world_size and None not in local
        expected = min(x for x in local if x is not None) if full else None
        windows = [rec.local_restorable for _, rec in ranked]
        if full and all(w is not None for w in windows):  # an SWA window: sets with holes
            common = set.intersection(*(set(w or ()) for w in windows))
            expected = max(common, default=0) * page
        # Verify one published hit, whole pages, the MIN of every rank's run (sglang#39147)
        if len(hits) > 1 or hit % page or (expected is not None and hit != expected):
            raise InvariantViolation(
                "INV-29",
                f"prefetch {request!r}: published hits {published} for rank runs {local} "
                f"(one hit, whole pages, the MIN over ranks of each rank's leading run; with a "
                f"trailing window, the longest prefix restorable on every rank: {windows})",
            )
        cuts = {rec.cut_tokens for _, rec in ranked}
        for rank, rec in ranked:
            pages = rec.hash_pages
            bounce = rec.bounce_tokens
            served = hit if rec.cut_tokens is None else rec.cut_tokens
            # Verify a cut (host pressure) is whole pages below the hit, the same on every rank
            if rec.cut_tokens is not None and (served % page or served >= hit or len(cuts) > 1):
                raise InvariantViolation(
                    "INV-29",
                    f"rank {rank} prefetch {request!r}: hit {hit} tokens cut to {served} (cuts "
                    f"{sorted(cuts, key=str)}; a cut is whole pages below the hit, alike on "
                    "every rank)",
                )
            # Verify the hit is served whole: its keys and its buffer cover it (sglang#40193)
            if (pages is not None and pages * page != served) or (
                bounce is not None and bounce != served
            ):
                raise InvariantViolation(
                    "INV-29",
                    f"rank {rank} prefetch {request!r}: hit {hit} tokens (served {served}) but "
                    f"{pages} page keys and a {bounce}-token bounce buffer (a hit is not "
                    "shortened on the way; the tree's cut for host room shortens all three)",
                )


# -- INV-37 ---------------------------------------------------------------------------------------
@registered("INV-37", StorageSnapshot, storage=0)
def check_inv_37_sidecar_all_or_nothing(evidence: Evidence) -> None:
    """Progress counts a page only once its sidecar (draft) page holds the oracle's bytes too."""
    snapshot = storage_snapshot_of("INV-37", evidence)
    page = snapshot.page_size
    for rank, records in enumerate(snapshot.prefetches):
        for record in records:
            for after, pages in zip(record.published_progress, record.sidecar_pages, strict=False):
                if after // page > pages:
                    raise InvariantViolation(
                        "INV-37",
                        f"rank {rank} prefetch {record.request_id!r}: published progress "
                        f"counts {after // page} page(s) but only {pages} hold the draft "
                        "sidecar's bytes (count a page only once its KV page and every "
                        "sidecar page of it were read; clamp to the fewest, as "
                        "_page_transfer_kv_batch's min)",
                    )
