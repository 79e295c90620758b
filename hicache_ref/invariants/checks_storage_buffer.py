"""Checker of buffer mode's storage existence beliefs (INV-41).

In a ``buffer_only`` world (``HarnessConfig.storage_buffer_only``) host memory holds no copy of
what L3 holds, so each rank's tree keeps *beliefs* of it (upstream's ``StorageExistenceCache``)
and skips a write whose pages it believes stored or in flight. The snapshot's ``beliefs`` hands,
per rank, what the tree's class holds for the KV pool beside what the harness's record of the
world allows (``harness/driver/storage_buffer.py``): the keys an acked write or a rank-agreed hit
taught and no drained hit query found missing since, with the verdict taken from what each
rank's backend answered; the writes launched and not yet acked; and the controller's last
prefetch rate-limit verdict with the host pages in use and the write staging then (buffer mode
charges loads only). It is empty in every other world, where the checker has nothing to judge.
"""

from __future__ import annotations

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import BeliefView, StorageSnapshot


def _why_believed(view: BeliefView, key: str) -> str:
    """Why ``key`` should not be believed, from the harness's record."""
    if key in view.refuted:
        return "a drained hit query found it missing since (the heal keeps no belief past it)"
    if any(k == key for k, _ in view.launched):
        return "its write is in flight, not yet acked (a belief follows the storage ack)"
    return "no acked write stored it and no rank-agreed hit found it"


def _check_believed(view: BeliefView) -> None:
    believed, taught = set(view.believed), set(view.taught)
    extra, missing = sorted(believed - taught), sorted(taught - believed)
    # Verify no belief precedes its ack or outlives a query that found the page missing
    if extra:
        key = extra[0]
        raise InvariantViolation(
            "INV-41",
            f"rank {view.rank} believes page {key[:16]} is in L3 but {_why_believed(view, key)}"
            f" ({len(extra)} such page(s)); a stale belief skips that page's backup for good",
        )
    # Verify an acked write or an agreed hit is remembered (the LRU bound is never reached)
    if missing:
        raise InvariantViolation(
            "INV-41",
            f"rank {view.rank} does not believe page {missing[0][:16]} is in L3 although its "
            f"write was acked or a rank-agreed hit found it ({len(missing)} such page(s))",
        )


def _check_inflight(view: BeliefView, quiescent: bool) -> None:
    # Verify a page is in flight exactly from its write's launch to its storage ack
    if view.inflight != view.launched:
        raise InvariantViolation(
            "INV-41",
            f"rank {view.rank} holds in-flight refs {dict(view.inflight)} but the writes "
            f"launched and not yet acked are {dict(view.launched)} (one ref per page from the "
            "launch, dropped at the storage ack)",
        )
    # Verify the staging is all given back at rest
    if quiescent and view.staged_tokens:
        raise InvariantViolation(
            "INV-41",
            f"rank {view.rank} still stages {view.staged_tokens} write tokens at rest (each "
            "write's staging is freed at its storage ack)",
        )


LOAD_POOL_USAGE_FRACTION = 0.9
"""How much of the host pool buffer mode's loads may fill (upstream's
``HICACHE_LOAD_POOL_USAGE_FRACTION``, 0.9 in 0.5.19 - 0.5.23)."""


def _check_admission(view: BeliefView) -> None:
    if view.admission is None:
        return
    limited, used, staged, size = view.admission
    loads = max(0, used - staged)
    expected = loads >= int(LOAD_POOL_USAGE_FRACTION * size)
    # Verify the rate limit charges loads only: write staging never parks a hit
    if limited != expected:
        said = "refused" if limited else "admitted"
        raise InvariantViolation(
            "INV-41",
            f"rank {view.rank}'s controller {said} a prefetch as rate limited with {used} of "
            f"{size} host tokens in use, {staged} of them write staging: loads hold {loads}, "
            f"the limit is {int(LOAD_POOL_USAGE_FRACTION * size)} (buffer mode charges loads "
            "only, never the write staging)",
        )


@registered("INV-41", StorageSnapshot, storage=0)
def check_inv_41_beliefs_follow_storage(evidence: Evidence) -> None:
    """A buffer-mode belief follows the storage ack or an agreed hit, and dies at a query that
    found the page missing; in-flight refs follow the writes; every rank believes alike; the
    rate limit charges loads only."""
    snapshot = storage_snapshot_of("INV-41", evidence)
    for view in snapshot.beliefs:
        _check_believed(view)
        _check_inflight(view, snapshot.quiescent)
        _check_admission(view)
    first = snapshot.beliefs[0] if snapshot.beliefs else None
    for view in snapshot.beliefs[1:]:
        assert first is not None
        # Verify every rank believes alike (admission is TP-deterministic)
        if view.believed != first.believed:
            raise InvariantViolation(
                "INV-41",
                f"rank {view.rank} believes {len(view.believed)} page(s) stored but rank "
                f"{first.rank} believes {len(first.believed)}: the ranks would admit different "
                "writes (every mutation is fed rank-agreed inputs)",
            )
