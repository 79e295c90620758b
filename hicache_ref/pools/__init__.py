"""KV pools: device pools, host pools, allocators, page arithmetic and the CP layout.

Primitives in the order data flows through them:

1. ``page_math`` / ``page_index``: token locs come in whole aligned pages (INV-01);
   ``pad_token_locs_to_page_boundary`` completes a partial last page.
2. ``CpSharedKVLayout`` (``cp_layout``): under CP, which rank owns a logical page and where it
   lives there.
3. ``PagedTokenToKVPoolAllocator`` (``allocator``): ``alloc`` device pages (``alloc_pages_with_owners`` replays
   a CP owner pattern, INV-03) ... ``free`` them (refusing double and foreign frees, INV-05).
4. ``MHATokenToKVPool`` / ``MLATokenToKVPool`` / ``NSATokenToKVPool`` (``device_pool``): the
   device KV the forward
   stores into (``notify_layer_end``) and reads (``get_key_buffer`` waits for the layer, INV-11).
   ``HybridLinearKVPool`` (``hybrid_pool``) wraps one of them as ``full_kv_pool`` next to the
   linear-attention state HiCache never caches; the controller unwraps it.
5. ``HostKVCache`` (``host_pool``; ``make_host_pool`` of ``host_pool_kinds``; where a row lives per layout:
   ``host_layout``): ``alloc`` host slots -> ``backup_from_device_*`` (d2h)
   -> ``get_data_page`` to storage / ``set_from_flat_data_page`` from storage ->
   ``load_to_device_per_layer`` (h2d) -> ``free``. Transfers are stream work (``transfer``): they
   are checked at launch and move bytes when the stream runs; a per-layer load or backup is
   checked and planned once per index pair, its later layers served by ``layer_launch``.
6. The copy paths of a transfer (``copy_path``), after ``transfer_checks`` validated its index
   pairs (INV-01): ``gather`` (CPU reference), ``runs`` (one ``copy_`` per merged run), and
   ``fast_transfer``'s two: ``batch``: ``copy_plan`` (index pairs -> byte offsets, once per
   transfer; every layer's addresses in one table) -> ``copy_engine`` (one
   ``cudaMemcpyBatchAsync`` per layer, issued by ``copy_issuer``'s native thread behind two
   stream operations, or ``memmove`` on the simulator; a load's layers as one stepped entry,
   its layer events recorded from C: ``layer_records``); ``triton``: ``triton_copy`` (a zero-copy kernel over the
   pinned host pool; its Triton source: ``triton_kernel``). ``copy_choice`` says which of them the default ``auto`` takes where the
   transfer runs (``gather`` on the CPU; on a GPU ``batch``, ``triton`` or ``runs``).

``PageFreeList`` (``free_pages``) is the shared bookkeeping behind both allocators, with the
``fifo`` / ``lifo`` / ``random`` handout policies.
"""

from hicache_ref.pools.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    pages_to_token_locs,
)
from hicache_ref.pools.cp_layout import CpSharedKVLayout
from hicache_ref.pools.device_pool import (
    KVCache,
    LayerBackupNotifier,
    LayerTransferCounter,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
)
from hicache_ref.pools.free_pages import ALLOC_POLICIES, AllocPolicy, PageFreeList
from hicache_ref.pools.host_layout import (
    HOST_LAYOUTS,
    IO_BACKENDS,
    LAYOUTS_BY_IO_BACKEND,
    HostLayout,
    IoBackend,
)
from hicache_ref.pools.host_pool import HostKVCache
from hicache_ref.pools.host_pool_kinds import (
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    NSATokenToKVPoolHost,
    make_host_pool,
)
from hicache_ref.pools.hybrid_pool import (
    HybridLinearKVPool,
    interleaved_layer_ids,
    unwrap_full_kv_pool,
)
from hicache_ref.pools.page_index import (
    pad_token_locs_to_page_boundary,
    validate_page_aligned_token_indices,
)
from hicache_ref.pools.transfer import COPY_PATHS, CopyPath

__all__ = [
    "ALLOC_POLICIES",
    "COPY_PATHS",
    "HOST_LAYOUTS",
    "IO_BACKENDS",
    "LAYOUTS_BY_IO_BACKEND",
    "AllocPolicy",
    "CopyPath",
    "CpSharedKVLayout",
    "HostKVCache",
    "HostLayout",
    "HybridLinearKVPool",
    "IoBackend",
    "KVCache",
    "LayerBackupNotifier",
    "LayerTransferCounter",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolHost",
    "NSATokenToKVPool",
    "NSATokenToKVPoolHost",
    "PageFreeList",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "interleaved_layer_ids",
    "make_host_pool",
    "pad_token_locs_to_page_boundary",
    "pages_to_token_locs",
    "unwrap_full_kv_pool",
    "validate_page_aligned_token_indices",
]
