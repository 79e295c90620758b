"""The tree half of an independent side pool's L3 window, modelled on 0.5.23's hybrid radix cache.

In a storage world with an SWA side pool (``storage_swa_window``) a prefetch names the pool's
window as a ``PoolTransfer`` of placeholder keys (``sglang_storage._window_prefetch_transfer``);
with a Mamba state pool the window is one page of one slot: a node's state, stored under its
last page key, and a prefetch's one placeholder key becomes the served hit's last page key
(``MambaComponent``'s ``PREFETCH`` transfer, the last-hit-page form of ``_sync_trailing_keys``);
the controller turns them into the hit's trailing keys (``_sync_trailing_keys``) and reads the
window after the KV pages (``_page_transfer_sidecar``). What the tree does around that, in the
order a prefetch meets it (upstream's ``UnifiedRadixCache`` names in brackets):

- ``staging_pages``: how many window pages a prefetch names (its placeholder keys);
- ``alloc_staging``: at the hit, once the KV bounce buffer is given, the window's host slots
  from the side pool's own allocator, sized by the hit *before* a host-pressure cut
  (``_alloc_prefetch_aux_staging(info, aux_hit_tokens)``); all transfers or none;
- ``note_pool_hits``: a progress ack's ``pool_hits`` while the prefetch is current
  (``_drain_ack_prefetch``: ``update_extra_pool_hit_pages``, ``pool_transfers_done``);
- ``is_whole``: the all-or-nothing verdict on the final result (``_check_hybrid_prefetch_
  result``): the KV pages of the hit all read and every window read in full, else discarded
  (INV-39 judges the verdict and the window it keeps);
- ``release_staging``: the window's slots back to the side pool (a discard, a result the tree
  does not keep, or the final ack of a prefetch whose window was never read);
- ``side_release_queue`` / ``drain_side_releases``: the controller's per-pool release queue
  (``extra_host_mem_release_queues[SWA]``: the window tail ``_sync_trailing_keys`` gives back
  when the served hit is shorter than the staged window) into the side pool.

Kept simple, and said so: the window covers every page of a chain the harness backs up (no
out-of-window tombstones), and the tree keeps a prefetched node only when the kept window
covers the whole node (its side host slots, which a later load brings back); a window of the
node's tail only goes back with the node's pages once judged (the tree's model holds a side
copy of every page of a node).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hicache_ref.storage.pool_transfers import WINDOW_POOLS, pool_name
from hicache_ref.storage.protocols import StorageHostPool


class SideTreeRank(Protocol):
    """What these functions read of one rank's tree half (``storage_tree.StorageTreeRank``)."""

    @property
    def cc(self) -> Any: ...
    @property
    def page_size(self) -> int: ...
    @property
    def side_host_pool(self) -> StorageHostPool | None: ...
    @property
    def side_done(self) -> dict[int, dict[str, int]]: ...
    @property
    def on_event(self) -> Callable[[str, dict[str, Any]], None]: ...


def staging_pages(
    prefetch_pages: int, window_pages: int, at_root: bool, state: bool = False
) -> int:
    """The SWA window a prefetch of ``prefetch_pages`` names (0.5.23's ``SWAComponent.
    prepare_prefetch``): the whole window when the span covers it, the span itself at the root
    (its whole SWA is the window), else none (a mid-tree short span's window head would come
    from the device prefix). A Mamba state pool (``state``) names its one page on every
    prefetch (``MambaComponent.prepare_prefetch``: one state slot per fetch)."""
    if window_pages <= 0 or prefetch_pages <= 0:
        return 0
    if state:
        return 1
    if prefetch_pages >= window_pages:
        return window_pages
    return prefetch_pages if at_root else 0


def side_transfers(operation: Any) -> list[Any]:
    """The prefetch's independent side-pool transfers (its own slots, not riding on the KV's)."""
    return [
        t
        for t in getattr(operation, "pool_transfers", None) or ()
        if getattr(t, "indices_from_pool", None) is None
    ]


def alloc_staging(rank: SideTreeRank, operation: Any, hit_tokens: int) -> bool:
    """Each side transfer's window slots: ``min(len(keys), hit pages)`` pages of the side pool
    (at its own page size: one slot for a Mamba state); on a shortfall what was taken goes
    back and nothing is staged."""
    pool = rank.side_host_pool
    assert pool is not None
    page = rank.page_size
    side_page = int(pool.page_size)
    taken: list[Any] = []
    for transfer in side_transfers(operation):
        if transfer.host_indices is not None:
            continue
        tokens = min(len(transfer.keys or ()), hit_tokens // page) * side_page
        if tokens == 0:
            continue
        slots = pool.alloc(tokens)
        if slots is None:
            release_staging(rank, taken)
            return False
        transfer.host_indices = slots
        taken.append(transfer)
        rank.on_event("side_staging", {"operation": operation, "slots": slots})
    return True


def note_pool_hits(rank: SideTreeRank, operation: Any, pool_hits: dict[str, int]) -> None:
    """A current prefetch's side reads are done: their published hits, by pool name."""
    rank.side_done[id(operation)] = {pool_name(k): int(v) for k, v in pool_hits.items()}


def is_whole(rank: SideTreeRank, operation: Any) -> bool:
    """Every KV page of the hit read, and every side transfer's window read in full."""
    transfers = side_transfers(operation)
    hits = rank.side_done.get(id(operation), {})
    expected = len(operation.hash_value) * rank.page_size
    return int(operation.completed_tokens) == expected and all(
        t.keys is not None and hits.get(pool_name(t.name), 0) == len(t.keys) for t in transfers
    )


def release_staging(rank: SideTreeRank, transfers: list[Any]) -> None:
    """The window slots of ``transfers`` back to the side pool (each transfer once)."""
    pool = rank.side_host_pool
    assert pool is not None
    for transfer in transfers:
        slots = transfer.host_indices
        if not isinstance(slots, torch.Tensor) or slots.numel() == 0:
            continue
        transfer.host_indices = None
        rank.on_event("side_free", {"slots": slots, "how": "staging"})
        pool.free(slots)


def side_release_queue(cc: Any) -> Any:
    """The controller's release queue of the window pool's host pages (SWA or Mamba), or
    None."""
    queues = getattr(cc, "extra_host_mem_release_queues", None) or {}
    return next((q for name, q in queues.items() if pool_name(name) in WINDOW_POOLS), None)


def side_release_count(cc: Any) -> int:
    queue = side_release_queue(cc)
    return 0 if queue is None else int(queue.qsize())


def drain_side_releases(rank: SideTreeRank, count: int) -> None:
    """``count`` items off the controller's side release queue, into the side pool."""
    queue = side_release_queue(rank.cc)
    pool = rank.side_host_pool
    if queue is None or pool is None or count <= 0:
        return
    slots = torch.cat([queue.get_nowait() for _ in range(count)])
    rank.on_event("side_free", {"slots": slots, "how": "released"})
    pool.free(slots)
