"""What the storage driver writes down of an SWA side pool's L3 window (INV-39 evidence).

A Mamba state pool's window (``storage:mamba``) is one page of one slot: the node's state,
judged by the same records at the side pool's own page size (``SideBook.side_page``).

The tree half (``storage_side.py``) stages a prefetch's window, hears the controller's pool
hits and judges the result all-or-nothing; these handlers turn its events and the backend's
calls into the harness's own records, in the order a prefetch meets them:

- ``swa_restorable``: the hit query's per-page SWA ``exists`` answers -> the prefix lengths
  whose trailing window this rank's backend holds (INV-29 judges the agreed hit by them);
- ``on_side_staging``: the window slots the tree staged, scribbled (a page never read in shows
  the scribble, not a stale copy of the same content);
- ``on_side_free``: side slots given back (the tree's, or the controller's release queue: a
  staged slot released there was given back by the controller, ``_sync_trailing_keys``);
- ``on_side_verdict``: the result judged: the served hit, its trailing window, the pages the
  controller kept and gave back, what each kept page holds against the harness's fill of the
  prefix it stands for (``StorageDriver._fill_side``), whether L3 holds the window and
  whether a fault hit a read of it, and the tree's verdict (``SideWindowRecord``);
- ``kept_window`` / ``adopt_window``: the window slots a kept result holds, which become the
  prefetched node's side slots when the window covers the whole node (else no node is kept);
- ``free_side_source``: a backup's SWA source pages back at its ack.

Nothing here reads the controller's transfers: slots come from the tree's own allocations and
the controller's release queue, bytes from the harness's pools, presence from the backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from hicache_ref.harness.driver.byte_checks import BOUNCE_DRAFT_ROW_VALUE
from hicache_ref.harness.driver.storage_chains import scribble_draft_rows
from hicache_ref.harness.driver.storage_side import side_release_queue
from hicache_ref.harness.world.recording_storage import BackendCall, page_digest
from hicache_ref.invariants.storage_snapshot import SideWindowRecord
from hicache_ref.storage.pool_transfers import (
    MAMBA_POOL,
    SWA_POOL,
    WINDOW_POOLS,
    component_key,
    restorable_prefixes,
)

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_chains import Chain
    from hicache_ref.harness.driver.storage_log import PrefetchLog, StorageLog
    from hicache_ref.harness.driver.storage_side_book import SideBook
    from hicache_ref.harness.driver.storage_tree import StorageTree
    from hicache_ref.harness.world.storage_world import StorageWorld

READ_FAULTS = ("get_fail", "short_read", "raise")


class DriverView(Protocol):
    """What these handlers read and write of the storage driver that hears them (a part of
    ``storage_events.DriverView``)."""

    page: int
    l3: StorageWorld
    log: StorageLog
    side: SideBook

    @property
    def chains(self) -> dict[int, Chain]: ...
    @property
    def storage_tree(self) -> StorageTree: ...
    def check(self) -> None: ...


def swa_restorable(calls: list[BackendCall], keys: list[str], trailing: int) -> tuple[int, ...]:
    """The prefix lengths of ``keys`` (the KV run) whose last ``trailing`` pages the backend
    said it holds in the window pool (SWA, or a Mamba state: a window of one page)."""
    present: set[str] = set()
    for call in (c for c in calls if c.kind == "sidecar_exists" and c.pool in WINDOW_POOLS):
        present.update(k.rsplit(".", 1)[0] for k in call.keys[: max(0, call.answer)])
    return tuple(restorable_prefixes([key in present for key in keys], trailing))


def on_side_staging(
    driver: DriverView, rank: int, log: PrefetchLog | None, slots: torch.Tensor
) -> None:
    driver.side.note(rank, slots, held=True)
    side = driver.l3.ranks[rank].side_host_pool
    if side is not None and slots.numel():
        scribble_draft_rows(side, slots, BOUNCE_DRAFT_ROW_VALUE)
    if log is not None:
        log.swa_staged.extend(int(s) for s in slots.tolist())


def on_side_free(driver: DriverView, rank: int, slots: torch.Tensor, how: str) -> None:
    driver.side.note(rank, slots, held=False)
    if how != "released":
        return
    freed = {int(s) for s in slots.tolist()}
    for log in driver.log.prefetches[rank].values():
        log.swa_released |= freed & set(log.swa_staged)


def free_side_source(driver: DriverView, rank: int, op_id: int) -> None:
    driver.side.free_source(driver.l3.ranks[rank], op_id)


def _queued_releases(driver: DriverView, rank: int) -> set[int]:
    """Side slots on the controller's SWA release queue now (given back, not yet drained)."""
    queue = side_release_queue(driver.l3.ranks[rank].controller)
    snapshot = getattr(queue, "snapshot", None)  # the reference's BoundedQueue, else a Queue
    held = [] if queue is None else snapshot() if callable(snapshot) else list(queue.queue)
    items = [t for t in held if t is not None]
    return {int(s) for t in items for s in t.tolist()}


def kept_window(driver: DriverView, rank: int, log: PrefetchLog) -> list[int]:
    """The slots of the staged window pages the controller did not give back, in order (at
    the side pool's page size: one slot per page of a Mamba state pool)."""
    page, staged = driver.side.side_page, log.swa_staged
    released = log.swa_released | (set(staged) & _queued_releases(driver, rank))
    pages = [staged[i * page : (i + 1) * page] for i in range(len(staged) // page)]
    return [slot for slots in pages if slots[0] not in released for slot in slots]


def adopt_window(
    driver: DriverView, rank: int, log: PrefetchLog, host: torch.Tensor
) -> torch.Tensor | None:
    """A kept result's window as its node's side slots, if it covers the whole node (the
    storage half holds them no more; a Mamba node's is its one state slot); None for a window
    of the node's tail only (no node)."""
    window = kept_window(driver, rank, log)
    if len(window) != (1 if driver.side.state else int(host.numel())):
        return None
    slots = torch.tensor(window, dtype=host.dtype)
    driver.side.note(rank, slots, held=False)
    return slots


def on_side_verdict(
    driver: DriverView, rank: int, log: PrefetchLog, op: Any, accepted: bool
) -> None:
    page, side_page = driver.page, driver.side.side_page
    served = log.cut_tokens if log.cut_tokens is not None else log.published_hit_tokens
    hit_pages = (served or 0) // page
    heads = log.swa_staged[::side_page][: len(log.swa_staged) // side_page]
    kept = kept_window(driver, rank, log)[::side_page]
    window = min(len(heads), hit_pages)
    tokens = driver.chains[log.chain_uid].tokens(page)
    prefixes = [
        log.anchor_prefix + tokens[: (j + 1) * page] for j in range(hit_pages - window, hit_pages)
    ]
    pool = driver.l3.ranks[rank].side_host_pool
    assert pool is not None
    landed = tuple(
        j < window
        and driver.log.expected_swa.get((rank, prefixes[j]))
        == page_digest(pool.get_data_page(head, True))
        for j, head in enumerate(kept)
    )
    keys = [driver.log.keyed.get((rank, prefix)) for prefix in prefixes]
    faults = driver.l3.ranks[rank].faults
    name = MAMBA_POOL if driver.side.state else SWA_POOL
    swa_keys = {component_key(k, name) for k in keys if k is not None}
    stored = (
        faults is not None and None not in keys and all(faults.inner.exists(k) for k in swa_keys)
    )
    faulted = faults is not None and any(
        f.kind in READ_FAULTS and f.key in swa_keys for f in faults.faults
    )
    hits = driver.storage_tree.ranks[rank].side_done.get(id(op))
    driver.log.side_windows.append(
        SideWindowRecord(
            rank=rank,
            request_id=log.request_id,
            epoch=log.epoch,
            hit_pages=hit_pages,
            completed_pages=log.published_tokens // page,
            staged_pages=len(heads),
            window_pages=window,
            released_pages=len(heads) - len(kept),
            published_pages=None if hits is None else hits.get(name),
            landed=landed,
            stored=stored,
            read_faulted=faulted,
            accepted=accepted,
            terminated=log.terminated_at is not None,
        )
    )
    driver.check()  # judged now: the window's slots go back next
