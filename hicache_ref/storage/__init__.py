"""The L3 storage tier: page keys, the backend interface, backends and fault injection.

Primitives, in the order data flows through them:

- ``compute_page_hashes`` / ``get_hash_str`` (``hashing``): chained content keys of whole pages;
- ``StorageOperation`` (backup), ``PrefetchOperation`` (a prefetch; its bounce buffer comes after
  the hit query, with the INV-19 release ledger) and ``PrefetchAck`` (its progress)
  (``operations``), queued on ``BoundedQueue``s (``queues``); what the tier needs of a host pool
  (``protocols``) and page-granular views of its index tensors (``pages``);
- ``HiCacheStorage`` (``backend``): ``batch_set`` -> ``batch_exists`` -> ``batch_get``, keyed by
  ``compute_storage_key`` (content key + rank split + layout-independent format tag), and the v2
  calls that move a sidecar pool's pages beside the KV's (``pool_transfers``: ``PoolTransfer``,
  ``component_key``, ``PoolTransferResult``);
- backends: ``MemoryStorage`` (``memory_backend``), ``FileStorage`` (``file_backend``), and
  ``FaultInjectingStorage`` (``fault_injection``) around either;
- ``StorageBackendFactory`` (``factory``): names -> backends, for ``attach_storage_backend``.

The controller side (the tier: its steps, executors, epochs, rank group) is
``hicache_ref.controller.storage``.
"""

from hicache_ref.storage.backend import (
    FLAT_PAGE_FORMAT_VERSION,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    compute_format_tag,
    compute_storage_key,
)
from hicache_ref.storage.factory import BackendBuilder, StorageBackendFactory
from hicache_ref.storage.fault_injection import FaultInjectingStorage, InjectedFault
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.hashing import Token, compute_page_hashes, get_hash_str
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.operations import (
    PrefetchAck,
    PrefetchOperation,
    PrefetchSplit,
    ReleasedRange,
    StorageOperation,
    compute_prefetch_split,
    is_valid_prefetch_split,
)
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import BoundedQueue, StorageQueueOverflow

__all__ = [
    "FLAT_PAGE_FORMAT_VERSION",
    "BackendBuilder",
    "BoundedQueue",
    "FaultInjectingStorage",
    "FileStorage",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "InjectedFault",
    "MemoryStorage",
    "PrefetchAck",
    "PrefetchOperation",
    "PrefetchSplit",
    "ReleasedRange",
    "StorageBackendFactory",
    "StorageHostPool",
    "StorageOperation",
    "StorageQueueOverflow",
    "Token",
    "compute_format_tag",
    "compute_page_hashes",
    "compute_prefetch_split",
    "compute_storage_key",
    "get_hash_str",
    "is_valid_prefetch_split",
]
