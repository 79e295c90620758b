"""The tier in ``buffer_only`` host memory: host pages as staging, loads alone rate limited.

In SGLang 0.5.19+'s buffer mode (``--hicache-host-memory-mode buffer_only``) host memory keeps
no copy of what L3 holds: a write's host pages are staging until its storage ack, a fetch's
until the tree loads them to the device. The tree then decides what to write from its beliefs
of what L3 holds (``existence_beliefs.StorageExistenceBeliefs``), which a drained hit query
heals from a per-pool verdict every rank agrees on. What changes in the tier, in the order a
prefetch meets it:

- ``check_host_memory_mode``: the mode a controller is built in (``cache`` or ``buffer_only``);
- ``compute_load_capacity_limit``: loads may fill ``LOAD_POOL_USAGE_FRACTION`` of the pool
  (cache mode leaves half of it to write-back instead);
- ``is_load_rate_limited``: a prefetch is refused when the host pages in use, *less the write
  staging* the tree reports (``host_write_staged_tokens_fn``), reach that limit: staging is the
  write budget's, so charging it here would park every hit behind the storage drain (INV-41);
- ``agree_pool_verdict``: the hit query's MIN over ranks carries, beside the hit, the KV pool's
  verdict (the leading pages this rank's backend answered; ``NO_POOL_VERDICT`` where the rank
  has no answer: a failed or skipped query), so a rank without an answer makes the agreed
  verdict none and the tree heals nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from hicache_ref.controller.storage.collectives import PREFETCH_HITS, Collectives, ReduceOp
from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.protocols import StorageHostPool

CACHE = "cache"
BUFFER_ONLY = "buffer_only"
HOST_MEMORY_MODES = (CACHE, BUFFER_ONLY)
LOAD_POOL_USAGE_FRACTION = 0.9
"""How much of the host pool buffer mode's loads may fill (SGLang's
``HICACHE_LOAD_POOL_USAGE_FRACTION``)."""
NO_POOL_VERDICT = -1
"""A rank's contribution to the agreed verdict when its query gave no answer (MIN keeps it)."""


@runtime_checkable
class StagingHostPool(Protocol):
    """A host pool that says how much of it is free (buffer mode's rate limit reads it)."""

    @property
    def size(self) -> int: ...

    def available_size(self) -> int: ...


def check_host_memory_mode(mode: str, mem_pool_host: object) -> str:
    """``mode`` if it is one SGLang names (buffer mode over a pool that says how much of it is
    free), else a ``HiCacheInputError`` naming the rule."""
    if mode not in HOST_MEMORY_MODES:
        raise HiCacheInputError(
            f"host_memory_mode={mode!r} is not a host memory mode: use one of "
            f"{HOST_MEMORY_MODES} (buffer_only: host pages are staging for L3, not a cache tier)"
        )
    if mode == BUFFER_ONLY and not isinstance(mem_pool_host, StagingHostPool):
        raise HiCacheInputError(
            f"host_memory_mode='buffer_only' over a {type(mem_pool_host).__name__}, which has "
            "no available_size(): buffer mode rate-limits loads by the host pages in use"
        )
    return mode


def compute_load_capacity_limit(mem_pool_host: StorageHostPool) -> int:
    """Tokens of the host pool buffer mode's loads may hold before prefetches are refused."""
    return int(LOAD_POOL_USAGE_FRACTION * mem_pool_host.size)


def is_load_rate_limited(
    mem_pool_host: StagingHostPool, staged_tokens: Callable[[], int] | None, limit: int
) -> bool:
    """Whether the loads alone (host tokens in use, less the tree's write staging) reach
    ``limit``: pending writes never park a hit."""
    used = mem_pool_host.size - mem_pool_host.available_size()
    if staged_tokens is not None:
        used -= staged_tokens()
    return max(0, used) >= limit


def agree_pool_verdict(
    collectives: Collectives, storage_hit_count: int, kv_pages: int | None
) -> tuple[int, int | None]:
    """One MIN over ranks of the hit and the KV pool's verdict (a single collective, as the
    hit alone is in cache mode): (the agreed hit, the agreed verdict or None where any rank
    had no answer)."""
    local = NO_POOL_VERDICT if kv_pages is None else kv_pages
    packed = torch.tensor([storage_hit_count, local], dtype=torch.int64)
    collectives.all_reduce(packed, op=ReduceOp.MIN, group=PREFETCH_HITS)
    hit, verdict = (int(v) for v in packed.tolist())
    return hit, None if verdict == NO_POOL_VERDICT else verdict
