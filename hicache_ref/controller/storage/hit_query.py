"""The hit query step (T1, SGLang 0.5.23's ``prefetch_thread_func``): one prefetch per step.

A step takes the oldest prefetch from ``prefetch_queue``, chains the page keys of its tokens
from the request's last hash, asks the backend ``batch_exists`` per batch and stops at the first
short batch (``_storage_hit_query``). It then MIN-reduces the hit count over ranks, *for every
prefetch, hit or miss or terminated* (``_sync_prefetch_hit_query``): one collective per step,
never one per batch, whose count would depend on rank-local hits (INV-20, sglang#30760). The
prefetch, its keys cut to the agreed hit, goes to ``prefetch_hit_queue`` for the tree. A
prefetch that names an independent side pool's window asks the span once with it and agrees on
the longest prefix every rank can restore, window included (``side_window.py``, INV-29). In
``buffer_only`` host memory the same collective also agrees on the KV pool's verdict, the
tree's evidence for healing its storage existence beliefs (``buffer_mode.py``, INV-41).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.buffer_mode import BUFFER_ONLY, agree_pool_verdict
from hicache_ref.controller.storage.collectives import PREFETCH_HITS, ReduceOp
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.controller.storage.side_window import (
    agreed_hit_tokens,
    query_windows,
    window_transfers,
)
from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageExtraInfo
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pool_transfers import KV_POOL

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import StepTier

logger = logging.getLogger("hicache_ref.controller.storage")


class HitQuery:
    """T1's loop body, and the pieces a mutant or an adapter may replace one at a time."""

    kind = StorageStepKind.HIT_QUERY

    def __init__(self, tier: StepTier) -> None:
        self.tier = tier

    def has_work(self) -> bool:
        return not self.tier.queues.prefetch_queue.empty()

    def step(self) -> StepResult:
        tier = self.tier
        operation = tier.queues.prefetch_queue.poll(0.0)
        if operation is None:
            return tier.idle_result(self.kind)
        tier.check_current_epoch(operation, "a hit query")
        operation.restorable_prefix_pages = []  # a window's: none until the query answers
        operation.query_pool_hit_pages = {}  # this rank's verdict: none until it answers
        hash_value: list[str]
        try:
            if operation.is_terminated():
                hash_value, storage_hit_count = [], 0
            else:
                hash_value, storage_hit_count = self.storage_hit_query(operation)
                operation.query_pool_hit_pages = {KV_POOL: storage_hit_count // tier.page_size}
        except InvariantViolation:
            raise
        except Exception:
            logger.info(
                "storage hit query failed for request %s", operation.request_id, exc_info=True
            )
            hash_value, storage_hit_count = [], 0
            operation.query_pool_hit_pages = {}
        storage_hit_count = self.sync_prefetch_hit_query(operation, storage_hit_count)
        self.publish_hit(operation, hash_value, storage_hit_count)
        return tier.result(self.kind, operation, tokens=storage_hit_count, acked=True)

    def storage_hit_query(self, operation: PrefetchOperation) -> tuple[list[str], int]:
        """Keys of the leading run of stored pages, and how many tokens they cover."""
        tier = self.tier
        backend = tier.require_backend("a hit query")
        page_hashes = tier.compute_page_keys(operation.token_ids, operation.last_hash)
        operation.all_hash_values = list(page_hashes)
        if window_transfers(operation):  # one query of the span with its windows
            kv_pages, restorable = query_windows(tier, backend, operation, page_hashes)
            operation.restorable_prefix_pages = restorable
            return page_hashes[:kv_pages], kv_pages * tier.page_size
        prefix_keys = operation.prefix_keys
        hash_value: list[str] = []
        hit_tokens = 0
        batch_pages = tier.storage_batch_size
        for start in range(0, len(page_hashes), batch_pages):
            batch_hashes = page_hashes[start : start + batch_pages]
            hit_pages = self.query_batch_exists(backend, batch_hashes, prefix_keys)
            hash_value.extend(batch_hashes[:hit_pages])
            hit_tokens += hit_pages * tier.page_size
            if hit_pages < len(batch_hashes):
                break  # a chain stops at its first miss
            if prefix_keys is not None:
                prefix_keys = (*prefix_keys, *batch_hashes)  # a new tuple (bug class 20)
        return hash_value, hit_tokens

    def query_batch_exists(
        self, backend: HiCacheStorage, keys: list[str], prefix_keys: tuple[str, ...] | None
    ) -> int:
        """The backend's leading hit run over ``keys``, clamped to ``[0, len(keys)]``; with
        sidecar pools, cut at the first page a sidecar lacks (INV-37)."""
        extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
        sidecars = self.tier.sidecar_transfers(keys)
        if sidecars:
            hit_pages = backend.batch_exists_v2(keys, sidecars, extra_info).kv_hit_pages
        else:
            hit_pages = backend.batch_exists(keys, extra_info)
        return max(0, min(int(hit_pages), len(keys)))

    def sync_prefetch_hit_query(self, operation: PrefetchOperation, storage_hit_count: int) -> int:
        """MIN of the hit count over ranks, so every rank agrees on the usable prefix; with a
        window, the longest prefix every rank restores (``side_window.agreed_hit_tokens``)."""
        if window_transfers(operation):
            pages = storage_hit_count // self.tier.page_size
            restorable = [p for p in operation.restorable_prefix_pages or () if p <= pages]
            return agreed_hit_tokens(self.tier, operation, restorable)
        if self.tier.host_memory_mode == BUFFER_ONLY:  # the KV pool's verdict rides along
            local = operation.query_pool_hit_pages.get(KV_POOL)
            hit, verdict = agree_pool_verdict(self.tier.collectives, storage_hit_count, local)
            operation.query_pool_hit_pages = {} if verdict is None else {KV_POOL: verdict}
            return hit
        hit_count = torch.tensor(storage_hit_count, dtype=torch.int64)
        self.tier.collectives.all_reduce(hit_count, op=ReduceOp.MIN, group=PREFETCH_HITS)
        return int(hit_count.item())

    def publish_hit(
        self, operation: PrefetchOperation, hash_value: list[str], storage_hit_count: int
    ) -> None:
        """Cut the keys to the agreed hit and hand the prefetch to the tree."""
        page_size = self.tier.page_size
        # Verify the agreed hit is whole pages of this rank's run (INV-29)
        if storage_hit_count % page_size or storage_hit_count > len(hash_value) * page_size:
            raise InvariantViolation(
                "INV-29",
                f"prefetch {operation.request_id!r} op {operation.id}: agreed hit "
                f"{storage_hit_count} is not whole pages within this rank's run of "
                f"{len(hash_value)} pages (the MIN over ranks never exceeds a rank's own run)",
            )
        operation.hash_value = hash_value[: storage_hit_count // page_size]
        operation.storage_hit_count = storage_hit_count
        operation.hit_known = True
        self.tier.queues.prefetch_hit_queue.put(operation)
