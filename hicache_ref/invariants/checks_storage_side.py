"""Checker of an independent side pool's L3 window: an SWA window, a Mamba state page (INV-39).

A Mamba state pool's page (``storage:mamba``) is the same rule with a window of one page: the
node's one state slot, keyed by the served hit's last page.

In a storage world with an SWA side pool (``HarnessConfig.storage_swa_window``) a prefetch names
the trailing window of its hit (``PoolHitPolicy.TRAILING_PAGES``); the controller re-aligns the
window's keys to the hit it serves, shrinks the window to it and reads it after the KV pages,
and the tree keeps the result only whole. The snapshot's ``side_windows`` is the harness's
record of each judged result per rank (``harness/driver/storage_side_events.py``); it is empty
in every other world, where the checker has nothing to judge. In the order the rule reads:

- a window is counted only with its KV: a published SWA hit needs every KV page of the hit;
- a kept result's window is exactly the served hit's trailing pages (the rest of the staged
  window given back), each holding the bytes written for the prefix it ends;
- a window L3 holds is not lost: a result whose KV pages all landed, not terminated, whose
  window every rank's L3 holds and whose reads no fault hit, is kept.
"""

from __future__ import annotations

from collections import defaultdict

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import SideWindowRecord, StorageSnapshot


def _where(record: SideWindowRecord) -> str:
    return (
        f"rank {record.rank} prefetch {record.request_id!r} (hit {record.hit_pages} page(s), "
        f"window {record.window_pages})"
    )


def _check_counted_with_kv(record: SideWindowRecord) -> None:
    # Verify the window is read only after every KV page of the hit landed (all-or-nothing)
    if record.published_pages and record.completed_pages != record.hit_pages:
        raise InvariantViolation(
            "INV-39",
            f"{_where(record)}: the controller published an SWA hit of "
            f"{record.published_pages} page(s) with {record.completed_pages} KV page(s) read "
            "(read a side window only once the KV pages of the hit all landed, as "
            "_page_transfer_sidecar's kv_completed_pages check does)",
        )


def _check_kept_window(record: SideWindowRecord) -> None:
    if not record.accepted:
        return
    kept = record.staged_pages - record.released_pages
    # Verify a kept window is the served hit's trailing pages, the staged rest given back
    if kept != record.window_pages:
        raise InvariantViolation(
            "INV-39",
            f"{_where(record)}: the result was kept with {kept} window page(s) of the "
            f"{record.staged_pages} staged ({record.released_pages} given back); the served "
            f"hit's trailing window is {record.window_pages} (re-align the keys to the served "
            "hit and release the staged tail: _sync_trailing_keys)",
        )
    # Verify each kept window page holds the bytes written for the prefix it ends
    if not all(record.landed):
        wrong = [i for i, ok in enumerate(record.landed) if not ok]
        raise InvariantViolation(
            "INV-39",
            f"{_where(record)}: window page(s) {wrong} of the kept result do not hold the SWA "
            "bytes written for the trailing pages of the served hit (read the keys of the hit "
            "actually served, after any cut, not of the query's hit)",
        )


def _check_not_lost(records: list[SideWindowRecord]) -> None:
    # Verify a window every rank's L3 holds, read without a fault, is kept
    whole = all(
        r.window_pages
        and r.completed_pages == r.hit_pages
        and r.stored
        and not r.read_faulted
        and not r.terminated
        for r in records
    )
    if whole and not any(r.accepted for r in records):
        first = records[0]
        raise InvariantViolation(
            "INV-39",
            f"{_where(first)}: every KV page landed and every rank's L3 holds the window, read "
            f"without a fault, but the controller published a window (SWA or Mamba state) hit "
            f"of {first.published_pages} page(s) and the result was discarded (a window L3 "
            "holds is not silently lost: key the window by the served hit's trailing pages and "
            "shrink the staged window to them before the read, _sync_trailing_keys)",
        )


@registered("INV-39", StorageSnapshot, storage=0)
def check_inv_39_side_window(evidence: Evidence) -> None:
    """An SWA window is counted with its KV, kept as the served hit's trailing pages with the
    bytes written for them, and not lost when L3 holds it."""
    snapshot = storage_snapshot_of("INV-39", evidence)
    by_request: dict[tuple[int, str], list[SideWindowRecord]] = defaultdict(list)
    for record in snapshot.side_windows:
        _check_counted_with_kv(record)
        _check_kept_window(record)
        by_request[(record.epoch, record.request_id)].append(record)
    for records in by_request.values():
        if len({r.rank for r in records}) == snapshot.world_size:
            _check_not_lost(records)
