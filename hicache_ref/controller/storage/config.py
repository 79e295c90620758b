"""What a tier tells its backend about itself: ``generate_storage_config`` and friends.

The config names the rank split, the model and whether the KV is an MLA pool (identical on
every TP rank, so only rank 0 writes it and its keys carry no TP split); the backend folds it
into every key with the pool's flat page format (``storage/backend.compute_storage_key``), so
ranks, models and page formats never share a key by accident (INV-28).
"""

from __future__ import annotations

from collections.abc import Mapping

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorageConfig
from hicache_ref.storage.protocols import StorageHostPool

MLA_POOL_CLASS_NAMES = frozenset({"MLATokenToKVPool", "NSATokenToKVPool"})
PREFETCH_CAPACITY_FRACTION = 0.5
"""Share of the host pool prefetch bounce buffers may hold (0.5.23 leaves half for write-back)."""


def is_mla_device_pool(mem_pool_device: object) -> bool:
    """Whether the device pool is an MLA pool (NSA pools are MLA pools with a sidecar)."""
    return any(cls.__name__ in MLA_POOL_CLASS_NAMES for cls in type(mem_pool_device).__mro__)


def compute_prefetch_capacity_limit(mem_pool_host: StorageHostPool) -> int:
    """Tokens the bounce buffers of all prefetches in flight may hold before rate limiting."""
    return int(PREFETCH_CAPACITY_FRACTION * mem_pool_host.size)


def generate_storage_config(
    mem_pool_host: StorageHostPool,
    mem_pool_device: object,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    enable_storage_metrics: bool,
    model_name: str | None = None,
    storage_backend_extra_config: Mapping[str, object] | None = None,
) -> HiCacheStorageConfig:
    """The backend's config; ``tp_lcm_size`` is taken out of a *copy* of the extra config (the
    seed popped it out of the caller's own dict)."""
    extra = dict(storage_backend_extra_config or {})
    is_mla = is_mla_device_pool(mem_pool_device)
    layout: str = mem_pool_host.layout
    tp_lcm_size = extra.pop("tp_lcm_size", None)
    should_split_heads = False
    if tp_lcm_size is not None:
        if not isinstance(tp_lcm_size, int) or tp_lcm_size < 1 or tp_lcm_size % tp_size:
            raise HiCacheInputError(
                f"tp_lcm_size={tp_lcm_size!r} must be a positive multiple of tp_size={tp_size}"
            )
        should_split_heads = not is_mla and layout == "page_head" and tp_lcm_size > tp_size
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        is_mla_model=is_mla,
        enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        tp_lcm_size=tp_lcm_size,
        should_split_heads=should_split_heads,
        extra_config=extra,
    )
