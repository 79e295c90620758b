"""An independent side pool's L3 window: the tier's part (SGLang 0.5.23's hybrid controller).

An independent side pool (``controller/side_pool.py``: an SWA pool, or a Mamba state pool) has
host slots of its own, so its pages do not ride on the KV's slots as a draft sidecar's do: the
tree names them on each call (``extra_pools``, SGLang's ``PoolTransfer`` with the
``trailing_pages`` policy), and a prefix is restorable from L3 only where the window of its
last ``len(keys)`` pages is stored too (a Mamba state: its one page, the state of the node
ending there). In the order a node and a prefetch meet it:

- ``window_transfers``: an operation's window transfers (own host slots, trailing pages);
- ``WindowPools``: the pools the tier stores windows of, registered with the backend at
  attach, and their release queues (``extra_host_mem_release_queues``), one per pool, kept
  across attaches and emptied by a reset, as upstream's;
- ``backup_windows``: a backup stores each window transfer's pages under ``<key>.<pool>``
  before the KV pages (``_trailing_chain_groups``: the prefix keys run up to the window); an
  MLA rank that skips the replicated KV still stores its rank-sharded Mamba state
  (``should_backup``) and acks the span only when every state page is stored;
- ``restorable_flags`` / ``agreed_hit_tokens``: the hit query's restorable prefixes, one flag
  per prefix length of the request's span, MIN over ranks: the agreed hit is the longest prefix
  restorable on *every* rank, never the MIN of each rank's longest (F28; INV-29);
- ``sync_trailing_keys``: at the read, each window's keys re-aligned to the last pages of the
  hit actually served (a cut hit's too), its staged slots shrunk to them and the tail given
  back on the pool's release queue (``_sync_trailing_keys``);
- ``read_windows``: the window read after every KV page of the hit landed, nothing otherwise:
  one ``PrefetchAck(pool_hits=...)`` on every rank alike, whatever the backend did;
- ``reduce_pool_hits``: the sync step's MIN over ranks of each window pool's hit, so the tree
  keeps a result only when every rank read its whole window (INV-39).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.collectives import (
    PREFETCH_COMPLETION,
    PREFETCH_HITS,
    ReduceOp,
)
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.storage.backend import HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation, StorageOperation
from hicache_ref.storage.pool_transfers import (
    MAMBA_POOL,
    TRAILING_PAGES,
    WINDOW_POOLS,
    PoolTransfer,
    count_pool_hits,
    pool_name,
)
from hicache_ref.storage.queues import BoundedQueue

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import StepTier
    from hicache_ref.storage.backend import HiCacheStorage
    from hicache_ref.storage.protocols import StorageHostPool

logger = logging.getLogger("hicache_ref.controller.storage")

STATE_POOLS = (MAMBA_POOL,)
"""Window pools whose pages are rank-sharded state: an MLA rank that skips the replicated KV
still stores them (upstream's ``should_backup``)."""


def is_window_transfer(transfer: PoolTransfer) -> bool:
    """An independent pool's transfer: its own host slots, its pages a trailing window."""
    return transfer.indices_from_pool is None and pool_name(transfer.hit_policy) == TRAILING_PAGES


def window_transfers(operation: StorageOperation) -> list[PoolTransfer]:
    """The operation's window transfers."""
    return [t for t in operation.pool_transfers or () if is_window_transfer(t)]


# -- the pools ---------------------------------------------------------------------------------
class WindowPools:
    """The window pools of one tier and the release queue of each (emptied by a reset)."""

    def __init__(self) -> None:
        self.pools: dict[str, StorageHostPool] = {}
        self.release_queues: dict[str, BoundedQueue[torch.Tensor]] = {}

    def add(self, name: str, host_pool: StorageHostPool) -> None:
        """Store ``name``'s windows; its host slots are its own (not the KV's)."""
        # Verify the pool is one whose pages are a hit's trailing window
        if name not in WINDOW_POOLS:
            raise HiCacheInputError(
                f"window pool {name!r}: the tier stores the windows of {', '.join(WINDOW_POOLS)} "
                "(a KV-derived pool is a sidecar: add_sidecar_pool)"
            )
        self.pools[name] = host_pool
        self.release_queues[name] = _release_queue(name, host_pool)

    def renew(self) -> None:
        """A reset: empty release queues (the queued slots are dropped, as the KV's: the side
        pool is cleared next). An attach keeps them: the tree drains them as before."""
        self.release_queues = {name: _release_queue(name, p) for name, p in self.pools.items()}

    def release(self, name: str, slots: torch.Tensor) -> None:
        """Queue ``slots`` of pool ``name``, page by page, for the tree to free."""
        pool, queue = self.pools[name], self.release_queues[name]
        for start in range(0, slots.numel(), pool.page_size):
            queue.put(slots[start : start + pool.page_size])


def _release_queue(name: str, pool: StorageHostPool) -> BoundedQueue[torch.Tensor]:
    return BoundedQueue(
        f"extra_host_mem_release_queues[{name}]",
        max(1, pool.size // pool.page_size),
        "drain it into the side pool every step; more means a slot was released twice",
    )


# -- backup ------------------------------------------------------------------------------------
def backup_windows(tier: StepTier, operation: StorageOperation) -> bool | None:
    """Store the operation's windows (each under ``<key>.<pool>``); whether every page of
    them was stored, None when it names none. A rank that skips backups stores its state
    pools only."""
    transfers = [
        t
        for t in window_transfers(operation)
        if not tier.backup_skip or pool_name(t.name) in STATE_POOLS
    ]
    if not transfers:
        return None
    backend = tier.require_backend("a backup")
    ok = True
    for transfer in transfers:
        keys = list(transfer.keys or ())
        covered = list(operation.hash_value[: len(operation.hash_value) - len(keys)])
        extra_info = HiCacheStorageExtraInfo(prefix_keys=_chained(operation.prefix_keys, covered))
        results = backend.batch_set_v2([transfer], extra_info)
        hits = count_pool_hits({transfer.name: results.get(pool_name(transfer.name), [])})
        ok = ok and hits[pool_name(transfer.name)] == len(keys)
    return ok


def _chained(prefix_keys: Sequence[str] | None, keys: Sequence[str]) -> tuple[str, ...] | None:
    return None if prefix_keys is None else (*prefix_keys, *keys)


# -- hit query ---------------------------------------------------------------------------------
def query_windows(
    tier: StepTier, backend: HiCacheStorage, operation: PrefetchOperation, keys: list[str]
) -> tuple[int, list[int]]:
    """One ``batch_exists_v2`` over the span's keys with the windows: the KV run's pages and
    this rank's restorable prefix lengths (with holes: a window may be stored at 2 and 4
    pages but not at 3)."""
    extra_info = HiCacheStorageExtraInfo(prefix_keys=operation.prefix_keys)
    result = backend.batch_exists_v2(keys, window_transfers(operation), extra_info)
    kv_pages = max(0, min(int(result.kv_hit_pages), len(keys)))
    restorable = result.restorable_prefix_pages
    pages = list(range(1, kv_pages + 1)) if restorable is None else list(restorable)
    return kv_pages, [p for p in pages if 0 < p <= kv_pages]


def restorable_flags(span_pages: int, restorable: Sequence[int]) -> list[int]:
    """One flag per prefix length 0 .. ``span_pages`` (the span is the same on every rank, so
    the collective's shape is too): 1 where this rank can restore it (0 always can)."""
    flags = [0] * (span_pages + 1)
    flags[0] = 1
    for pages in restorable:
        if 0 < pages <= span_pages:
            flags[pages] = 1
    return flags


def agreed_hit_tokens(tier: StepTier, operation: PrefetchOperation, restorable: list[int]) -> int:
    """MIN over ranks of every prefix length's flag: the longest prefix every rank restores
    (0.5.23's per-prefix reduce; the MIN of each rank's longest may be one some rank cannot
    restore, F28)."""
    span_pages = len(operation.token_ids) // tier.page_size
    flags = torch.tensor(restorable_flags(span_pages, restorable), dtype=torch.int64)
    tier.collectives.all_reduce(flags, op=ReduceOp.MIN, group=PREFETCH_HITS)
    agreed = [i for i, ok in enumerate(flags.tolist()) if ok]
    return max(agreed) * tier.page_size


# -- the read ----------------------------------------------------------------------------------
def sync_trailing_keys(
    tier: StepTier, transfers: list[PoolTransfer], hashes: Sequence[str], hit_pages: int
) -> None:
    """Each window's keys become the last pages of the hit served (``hashes[:hit_pages]``),
    its staged slots shrink to them and the tail goes back on its pool's release queue."""
    for transfer in transfers:
        trailing = len(transfer.keys) if transfer.keys else 1
        transfer.keys = list(hashes[max(0, hit_pages - trailing) : hit_pages])
        slots = transfer.host_indices
        name = pool_name(transfer.name)
        if slots is None:
            continue
        needed = len(transfer.keys) * tier.window_pools.pools[name].page_size
        if slots.numel() > needed:  # the hit undershot the staged window
            tier.window_pools.release(name, slots[needed:])
            transfer.host_indices = slots[:needed]


SyncKeys = Callable[[list[PoolTransfer], Sequence[str], int], None]
"""``sync_trailing_keys`` bound to a tier (``PrefetchIO.sync_trailing_keys``, a mutant's seam)."""


def read_windows(
    tier: StepTier, operation: PrefetchOperation, kv_pages: int, sync: SyncKeys
) -> None:
    """After the last KV batch: read the windows if every KV page of the hit landed and the
    prefetch runs, else nothing; one pool-hit ack either way (every rank emits it)."""
    transfers = window_transfers(operation)
    if not transfers:
        return
    pool_hits: dict[str, int] = {}
    if not operation.is_terminated() and kv_pages == len(operation.hash_value):
        sync(transfers, operation.hash_value, kv_pages)
        try:
            pool_hits = _read(tier, operation, transfers)
        except InvariantViolation:
            raise
        except Exception:
            logger.info("window read failed for request %s", operation.request_id, exc_info=True)
            pool_hits = {}
    tier.queues.prefetch_sync_queue.put(
        PrefetchAck(rid=operation.request_id, operation=operation, pool_hits=pool_hits)
    )


def _read(
    tier: StepTier, operation: PrefetchOperation, transfers: list[PoolTransfer]
) -> dict[str, int]:
    backend = tier.require_backend("a window read")
    results: dict[str, list[bool]] = {}
    for transfer in transfers:
        covered = operation.hash_value[: len(operation.hash_value) - len(transfer.keys or ())]
        extra_info = HiCacheStorageExtraInfo(prefix_keys=_chained(operation.prefix_keys, covered))
        results.update(backend.batch_get_v2([transfer], extra_info))
    return count_pool_hits(results)


def reduce_pool_hits(tier: StepTier, ack: PrefetchAck) -> None:
    """MIN over ranks of each window pool's hit (a pool a rank did not read counts 0)."""
    if ack.pool_hits is None:
        return
    local = dict(ack.pool_hits)
    packed = torch.tensor([local.get(name, 0) for name in WINDOW_POOLS], dtype=torch.int64)
    tier.collectives.all_reduce(packed, op=ReduceOp.MIN, group=PREFETCH_COMPLETION)
    ack.pool_hits = {name: int(v) for name, v in zip(WINDOW_POOLS, packed.tolist(), strict=True)}
