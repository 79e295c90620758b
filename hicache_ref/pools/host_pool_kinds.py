"""The host pool of each device pool kind, and ``make_host_pool``, which picks it.

``HostKVCache`` (``host_pool``) serves every kind; these name its components' buffers as
SGLang's host pool classes do: ``MHATokenToKVPoolHost`` (``k``, ``v``),
``MLATokenToKVPoolHost`` (``kv``), ``NSATokenToKVPoolHost`` (``kv`` and the indexer sidecar
``index_k``, moved with the KV: sglang#17085). ``make_host_pool`` builds the one matching a
device pool's exact type.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hicache_ref.pools.device_pool import (
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
)
from hicache_ref.pools.host_pool import HostKVCache


class MHATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MHATokenToKVPool`` (components ``k``, ``v``)."""

    device_pool_kind = MHATokenToKVPool
    pool_kind = "mha"

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.buffers["k"]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.buffers["v"]


class MLATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MLATokenToKVPool`` (component ``kv``); refuses an NSA pool (sglang#17085)."""

    device_pool_kind: ClassVar[type[KVCache] | None] = MLATokenToKVPool
    pool_kind: ClassVar[str | None] = "mla"

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.buffers["kv"]


class NSATokenToKVPoolHost(MLATokenToKVPoolHost):
    """Host pool of an ``NSATokenToKVPool`` (components ``kv`` and the sidecar ``index_k``)."""

    device_pool_kind = NSATokenToKVPool
    pool_kind = "nsa"

    @property
    def index_k_buffer(self) -> torch.Tensor:
        return self.buffers["index_k"]


def make_host_pool(device_pool: KVCache, **kwargs: Any) -> HostKVCache:
    """The host pool class matching ``device_pool``'s exact type (keyword arguments as
    ``HostKVCache``)."""
    for host_class in (MHATokenToKVPoolHost, MLATokenToKVPoolHost, NSATokenToKVPoolHost):
        if type(device_pool) is host_class.device_pool_kind:
            return host_class(device_pool, **kwargs)
    return HostKVCache(device_pool, **kwargs)
