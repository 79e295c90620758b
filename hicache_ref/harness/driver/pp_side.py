"""The harness's byte model of an independent side pool on a PP world's tickets (INV-39).

In a PP world with an SWA side pool (``pp_config(swa_window=N)``: ``pool_group="swa"``,
``storage_swa_window``) every backup stores each page's SWA rows beside its KV page, and PP rank
0's ``submit_prefetch`` names the window as a ``TRAILING_PAGES`` transfer of placeholder keys
with no slots (``PPPrefetchPoolSpec.num_slots == 0``), as 0.5.23's hybrid radix cache does: each
rank's command thread then allocates the window from its own side pool next to the KV staging
(``_allocate_pp_prefetch_buffers``: ``min(keys, own hit pages)`` pages, all pools or none), and
its IO re-aligns the window to the served hit's trailing keys after the KV pages, giving the
staged tail back on the SWA release queue (``_sync_trailing_keys``). In the order a chain and a
ticket meet them:

- ``side_entry`` / ``side_pool_of`` / ``window_pool`` / ``is_state`` / ``side_page`` /
  ``side_room``: the rank's window entry of its ``HostPoolGroup`` (SWA, or MAMBA below: its own
  slots), the pool the harness fills and reads, its name, its page, its room for a backup;
- ``fill_side``: a backup's SWA source pages, filled with the rank's own bytes for the chain
  (``pp_world.side_value``); the digests the model expects back, by (rank, page key) (no room
  is bad input: the gate backs up only with room in both pools, ``PpTree.has_room``);
- ``window_transfer``: the ticket's SWA transfer (``staging_pages``: the whole window when the
  span covers it, the span at the root, else none);
- ``queued_side_releases`` / ``drain_side_releases``: the controller's SWA release queue (what it
  gave back), read and drained into the side pool;
- ``taken_window`` / ``window_record``: at the take, what the rank's kept window holds against the model: the
  served hit, the trailing window of it, the pages staged and given back, each kept page's
  bytes, whether L3 holds the window and whether a fault hit a read of it
  (``SideWindowRecord``, judged by INV-39 exactly as in a non-PP SWA world); ``free_window``:
  then buffer mode's load frees the kept window; ``side_held``: what a ticket holds (INV-38).

Nothing here reads what the controller says of its window: slots come from the harness's book of
the side pool's ``alloc`` / ``free`` (``pp_books``) and the release queue, bytes from the pool,
presence and faults from the backend.

A Mamba PP world (``pp_config(mamba=True)``: ``pool_group="mamba"``) runs the same functions over
the group's ``MAMBA`` entry, a state pool whose pages are one slot (``window_pool``, ``is_state``):
a backup stores one state per chain, the harness's own bytes for it (``pp_world.state_value``),
under the chain's last page key (what the harness expects back under that key alone); every
ticket names one placeholder key (``staging_pages(state=True)``: one state slot per fetch, mid-tree
too); each rank allocates one slot, and its IO keys it by the served hit's last page. A kept state
slot is judged as a window of one page: the bytes written for the chain whose last page is the
served hit's last page, and a state L3 holds is never lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.sglang_storage import _window_prefetch_transfer
from hicache_ref.harness.driver.pp_world import side_value, state_value
from hicache_ref.harness.driver.storage_side import staging_pages
from hicache_ref.harness.world.recording_storage import page_digest
from hicache_ref.invariants.storage_snapshot import SideWindowRecord
from hicache_ref.storage.pool_transfers import MAMBA_POOL, WINDOW_POOLS, component_key, pool_name

READ_FAULTS = ("get_fail", "short_read", "raise")


def side_entry(controller: Any) -> Any | None:
    """The rank's window entry of its host pool group (SWA or MAMBA: an independent pool), or
    None."""
    entries = getattr(controller.mem_pool_host, "entry_map", None) or {}
    return next((e for name, e in entries.items() if pool_name(name) in WINDOW_POOLS), None)


def side_pool_of(controller: Any) -> Any:
    entry = side_entry(controller)
    assert entry is not None, "a side-pool PP world's group has an SWA or MAMBA entry"
    return entry.host_pool


def window_pool(controller: Any) -> str:
    """The name of the rank's window pool: ``swa``, or ``mamba`` (a state pool)."""
    entry = side_entry(controller)
    assert entry is not None, "a side-pool PP world's group has an SWA or MAMBA entry"
    return pool_name(entry.name)


def is_state(controller: Any) -> bool:
    """The window pool holds one state per chain (Mamba), not a page per KV page."""
    return window_pool(controller) == MAMBA_POOL


def side_page(controller: Any) -> int:
    """Slots per page of the window pool: the anchor's page (SWA), one slot (a Mamba state)."""
    return int(side_pool_of(controller).page_size)


def side_room(controller: Any, pages: int) -> bool:
    """The window pool has room for a ``pages``-page backup's source (one state slot in a
    Mamba world)."""
    need = side_page(controller) * (1 if is_state(controller) else pages)
    return int(side_pool_of(controller).available_size()) >= need


def fill_side(
    controller: Any,
    who: tuple[int, int],
    keys: list[str],
    page: int,
    expected: dict[tuple[int, str], str],
) -> Any:
    """A backup's window source for ``who`` = (rank, chain): a side page per key, filled with
    the rank's own bytes of the chain (a Mamba world: one state slot, the chain's state, stored
    under its last key); the digest of each goes into ``expected`` by (rank, key)."""
    rank, chain = who
    pool = side_pool_of(controller)
    state = is_state(controller)
    stored = keys[-1:] if state else keys
    slots = pool.alloc(len(stored) * side_page(controller))
    if slots is None:
        raise HiCacheInputError(f"no side room for a {len(keys)}-page backup on rank {rank}")
    for position, key in enumerate(stored):
        flat = pool.get_dummy_flat_data_page()
        first = state_value(rank, chain) if state else side_value(rank, chain, position)
        data = torch.arange(flat.numel(), dtype=flat.dtype) / 1024 + first
        pool.set_from_flat_data_page(int(slots[position * side_page(controller)]), data)
        expected[(rank, key)] = page_digest(data)
    return slots


def window_transfer(
    controller: Any, span_pages: int, window_pages: int, at_root: bool
) -> list[Any] | None:
    """The ticket's ``pool_transfers``: the window pool's placeholder keys (a Mamba state's one,
    on every ticket), or None (no window)."""
    staging = staging_pages(span_pages, window_pages, at_root, is_state(controller))
    return [_window_prefetch_transfer(window_pool(controller), staging)] if staging else None


def _release_queue(controller: Any) -> Any | None:
    queues = getattr(controller, "extra_host_mem_release_queues", None) or {}
    return next((q for name, q in queues.items() if pool_name(name) in WINDOW_POOLS), None)


def queued_side_releases(controller: Any) -> set[int]:
    """Side slots on the controller's window release queue now (given back, not yet drained)."""
    queue = _release_queue(controller)
    items = [] if queue is None else [t for t in list(queue.queue) if t is not None]
    return {int(s) for t in items for s in t.tolist()}


def drain_side_releases(controller: Any) -> list[int]:
    """Every page on the controller's window release queue back into the side pool; the
    slots."""
    queue = _release_queue(controller)
    freed: list[int] = []
    while queue is not None and not queue.empty():
        slots = queue.get_nowait()
        if slots is not None and len(slots):
            side_pool_of(controller).free(slots)
            freed.extend(int(s) for s in slots.tolist())
    return freed


@dataclass(frozen=True)
class TakenWindow:
    """What the tree saw of one rank's ticket at its take (the harness's own records)."""

    rank: int
    request_id: str
    epoch: int
    hit_tokens: int  # the rank-agreed hit the command thread staged
    completed_tokens: int  # the KV tokens the completion counts
    staged: tuple[int, ...]  # side slots the command thread allocated for it, in order
    given_back: frozenset[int]  # of those, the ones the controller gave back (release queue)
    span_keys: tuple[str, ...]  # the ticket's page keys (its tokens after its last_hash)
    window_keys: int  # placeholder keys the ticket's spec named (the window it asked for)
    published_pages: int | None  # the window hit the sync thread published (None: no verdict)
    accepted: bool  # the tree keeps the result (all-or-nothing)


def taken_window(
    book: Any,
    controller: Any,
    who: tuple[int, str, int],
    tokens: tuple[int, int],
    span_keys: tuple[str, ...],
    window_keys: int,
    operation: Any,
) -> TakenWindow:
    """What the tree saw of ``who`` = (rank, request, epoch)'s window as it takes the ticket
    (``tokens`` = its agreed hit and completed tokens): the side slots ``book`` says its command
    thread allocated, the ones given back, and the tree's all-or-nothing verdict on the window hit
    the sync thread published beside the completion."""
    rank, rid, epoch = who
    hit, done = tokens
    staged = tuple(book.side_staged.get((epoch, rid), ()))
    given_back = book.side_given_back.get((epoch, rid), set()) | (
        set(staged) & queued_side_releases(controller)
    )
    hits = getattr(operation.pool_storage_result, "extra_pool_hit_pages", None) or {}
    pool = window_pool(controller)
    published = next((int(v) for k, v in hits.items() if pool_name(k) == pool), None)
    window = min(
        window_keys, hit // int(controller.page_size), len(staged) // side_page(controller)
    )
    return TakenWindow(
        rank, rid, epoch, hit, done, staged, frozenset(given_back), span_keys, window_keys,
        published, accepted=bool(window) and done == hit and published == window,
    )  # fmt: skip


def free_window(controller: Any, operation: Any) -> None:
    """Buffer mode owns a taken ticket's window (its kept pages): loaded, then freed."""
    for transfer in getattr(operation, "pool_transfers", None) or ():
        slots = transfer.host_indices
        if transfer.indices_from_pool is None and slots is not None and slots.numel():
            side_pool_of(controller).free(slots)
            transfer.host_indices = None


def side_held(book: Any, controller: Any, rid: str) -> int:
    """The side-pool slots ``book`` says ``rid`` holds, less the ones the controller gave back
    on its window release queue (not yet drained)."""
    queued = queued_side_releases(controller)
    owners = book.side_owners
    return sum(1 for slot, owner in owners.items() if owner == rid and slot not in queued)


def window_record(
    taken: TakenWindow,
    page: int,
    pool: Any,
    expected: dict[tuple[int, str], str],
    faults: Any,
    name: str,
) -> SideWindowRecord:
    """``taken`` judged against the model: the trailing window of the served hit and the bytes
    each kept page holds (read from ``pool`` at its slot; a page of the pool's own size: one
    slot for a Mamba state, whose window is the served hit's last page)."""
    hit_pages = taken.hit_tokens // page
    slots = int(pool.page_size)
    heads = list(taken.staged[::slots][: len(taken.staged) // slots])
    kept = [head for head in heads if head not in taken.given_back]
    window = min(len(heads), taken.window_keys, hit_pages)
    trailing = taken.span_keys[hit_pages - window : hit_pages] if window else ()
    landed = tuple(
        j < window
        and expected.get((taken.rank, trailing[j])) == page_digest(pool.get_data_page(head, True))
        for j, head in enumerate(kept)
    )
    side_keys = {component_key(k, name) for k in trailing}
    stored = faults is not None and all(
        k not in faults.evicted and faults.inner.exists(k) for k in side_keys
    )
    faulted = faults is not None and any(
        f.kind in READ_FAULTS and f.key in side_keys for f in faults.faults
    )
    return SideWindowRecord(
        rank=taken.rank,
        request_id=taken.request_id,
        epoch=taken.epoch,
        hit_pages=hit_pages,
        completed_pages=taken.completed_tokens // page,
        staged_pages=len(heads),
        window_pages=window,
        released_pages=len(heads) - len(kept),
        published_pages=taken.published_pages,
        landed=landed,
        stored=stored,
        read_faulted=faulted,
        accepted=taken.accepted,
    )
