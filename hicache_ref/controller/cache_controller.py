"""HiCacheController: SGLang's hierarchical KV-cache controller, as a checked reference.

Protocol, in the order data flows:
- ``write(device_indices, node_id)`` allocates host slots and issues the D2H of all layers on
  ``write_stream`` at once (fenced after the current stream), appending one ``HiCacheAck``;
- the tree drains a FIFO prefix of completed acks (``ack_write_queue``) and unlocks those nodes;
- ``evict_device`` / ``evict_host`` free pages that no pending transfer uses (INV-07, INV-08);
- ``load(host_indices, node_id)`` allocates device pages and queues the op; ``start_loading()``
  takes a producer slot and issues the H2D layer by layer on ``load_stream``, recording one event
  per layer so the forward can start reading layer 0 while later layers still land;
- the tree drains ``ack_load_queue`` and unpins the loaded nodes.
CP shared KV (``cp_write.py``, ``cp_load.py``), draft pools (ride along every transfer) and
an independent side pool (``side_pool.py``: its own rows and slots, named on each call) extend
this core; the L3 storage tier is an object the controller owns (``self.storage``, a
``controller/storage/StorageTier``), its seed-named methods delegating (``storage_facade.py``).
In ``buffer_only`` host memory (``host_memory_mode``) the tier rate-limits loads alone and the
controller holds the tree's storage existence beliefs (``storage_existence_cache``,
``controller/storage/existence_beliefs.py``), as it holds an independent side pool.

A hybrid (full + linear attention) device pool is unwrapped to its ``full_kv_pool`` first; the
pools get the controller's hooks only once construction can no longer fail (F19). A copy that
fails to launch rolls its call back and raises one ``TransferLaunchError`` (``rollback.py``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from hicache_ref.controller.base import ControllerState, logger
from hicache_ref.controller.cp_load import CpLoadMixin
from hicache_ref.controller.cp_write import CpWriteMixin
from hicache_ref.controller.inflight import InflightTracker
from hicache_ref.controller.operations import (
    CacheOperation,
    DraftLayerCounterView,
    HiCacheAck,
    LayerDoneCounter,
    LayerLoadingEvent,
)
from hicache_ref.controller.rollback import rolled_back_on_failure, take_checkpoint
from hicache_ref.controller.side_pool import SidePoolMixin
from hicache_ref.controller.storage.buffer_mode import BUFFER_ONLY, CACHE
from hicache_ref.controller.storage.collectives import Collectives
from hicache_ref.controller.storage.executor import ExecutorFactory
from hicache_ref.controller.storage.existence_beliefs import StorageExistenceBeliefs
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.controller.storage_facade import StorageFacade
from hicache_ref.device.protocol import DeviceModule, StreamT
from hicache_ref.errors import (
    DraftPoolPairError,
    HiCacheInputError,
    InvariantViolation,
    UnknownOptionError,
)
from hicache_ref.pools.page_index import get_small_cpu_values
from hicache_ref.storage.pool_transfers import DRAFT_POOL

if TYPE_CHECKING:
    from hicache_ref.invariants.models import HiCacheWriteFailure, HiCacheWriteResult
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.device_pool import KVCache
    from hicache_ref.pools.host_pool import HostKVCache


class HiCacheController(StorageFacade, CpWriteMixin, CpLoadMixin, SidePoolMixin, ControllerState):
    """The controller; public methods keep the seed's names, arguments and behaviour."""

    storage_tier_class: type[StorageTier] = StorageTier
    existence_beliefs_class: type[StorageExistenceBeliefs] = StorageExistenceBeliefs

    def __init__(
        self,
        token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator,
        mem_pool_host: HostKVCache,
        page_size: int,
        tp_group: object = None,
        load_cache_event: threading.Event | None = None,
        write_policy: str = "write_through_selective",
        io_backend: str = "direct",
        storage_backend: str | None = None,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: dict[str, Any] | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        enable_storage_metrics: bool = False,
        cp_shared_kv_layout: CpSharedKVLayout | None = None,
        draft_mem_pool_host: HostKVCache | None = None,
        draft_mem_pool_device: KVCache | None = None,
        *,
        device_module: DeviceModule | None = None,
        num_counters: int = 5,
        storage_executor: str | ExecutorFactory = "thread",
        storage_collectives: Collectives | None = None,
        host_memory_mode: str = CACHE,
    ) -> None:
        from hicache_ref.pools.device_pool import NSATokenToKVPool
        from hicache_ref.pools.hybrid_pool import unwrap_full_kv_pool

        self.tp_group = tp_group
        self.load_cache_event = load_cache_event
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        # A hybrid (full + linear attention) pool: HiCache caches its full-attention layers only
        self.mem_pool_device = unwrap_full_kv_pool(token_to_kv_pool_allocator.get_kvcache())
        self.device_module = device_module or self.mem_pool_device.device_module
        if page_size < 1 or page_size != mem_pool_host.page_size:
            raise HiCacheInputError(
                f"page_size={page_size} must be >= 1 and equal the host pool's page_size="
                f"{mem_pool_host.page_size}"
            )
        self._validate_options(write_policy, io_backend, mem_pool_host.layout)
        self.cp_shared_kv_layout = cp_shared_kv_layout
        self.uses_cp_hicache = cp_shared_kv_layout is not None
        if self.uses_cp_hicache and not isinstance(self.mem_pool_device, NSATokenToKVPool):
            raise HiCacheInputError(
                "CP shared KV HiCache requires an NSATokenToKVPool device pool, got "
                f"{type(self.mem_pool_device).__name__}"
            )
        self.mem_pool_host = mem_pool_host
        self.write_policy = write_policy
        self.page_size = page_size
        self.io_backend = io_backend
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.enable_storage_metrics = enable_storage_metrics
        self.device = self.mem_pool_device.device
        self.layer_num = self.mem_pool_device.layer_num

        self.storage = self.storage_tier_class(
            mem_pool_host,
            self.mem_pool_device,
            page_size,
            executor=storage_executor,
            collectives=storage_collectives,
            pp_rank=pp_rank,
            pp_size=pp_size,
            enable_storage_metrics=enable_storage_metrics,
            uses_cp_hicache=self.uses_cp_hicache,
            host_memory_mode=host_memory_mode,
        )
        # buffer mode: what the tree believes L3 holds (SGLang's tree keeps it; we have none)
        self.storage_existence_cache: StorageExistenceBeliefs | None = (
            self.existence_beliefs_class() if host_memory_mode == BUFFER_ONLY else None
        )
        self.stop_event = threading.Event()

        self.layer_done_counter = LayerDoneCounter(
            self.layer_num, self.device_module, num_counters=num_counters
        )

        self.load_queue: list[CacheOperation] = []
        self.write_queue: list[CacheOperation] = []
        self.draft_load_queue: list[CacheOperation] = []
        self.draft_write_queue: list[CacheOperation] = []
        self.ack_load_queue: list[HiCacheAck] = []
        self.ack_write_queue: list[HiCacheAck] = []
        self.pending_layer_writes = {}
        self._max_write_ack_node_id = -1
        self.inflight = InflightTracker()

        self.draft_mem_pool_device = None
        self.draft_mem_pool_host = None
        self.mem_pool_device_draft: KVCache | None = None
        self.mem_pool_host_draft: HostKVCache | None = None
        has_draft_pair = draft_mem_pool_host is not None or draft_mem_pool_device is not None
        if has_draft_pair:
            # Refuse a bad draft pair now; it is attached (with its hooks) once nothing can fail
            self._check_draft_attachable(draft_mem_pool_device, draft_mem_pool_host)

        self.write_stream = self.device_module.Stream()
        self.load_stream = self.device_module.Stream()
        # Set by a scheduler whose forward runs on its own stream (overlap scheduling): every
        # D2H / H2D then waits for that stream too, not only for the caller's (sglang#36738)
        self.write_fence_stream: StreamT | None = None
        self.load_fence_stream: StreamT | None = None

        if storage_backend is not None:
            try:
                self.attach_storage_backend(
                    storage_backend=storage_backend,
                    prefetch_threshold=prefetch_threshold,
                    model_name=model_name,
                    storage_backend_extra_config=storage_backend_extra_config,
                )
            except ValueError as e:
                raise UnknownOptionError(f"Failed to create storage backend: {e}") from e
        # Hooks last, after everything that can fail: a refused constructor must not leave a
        # half-built controller wired into the pools the process keeps (F19)
        self._register_pool_hooks()
        if has_draft_pair:
            self.attach_draft_pool(draft_mem_pool_device, draft_mem_pool_host)

    def _register_pool_hooks(self) -> None:
        """Make the target device pool wait on our load events and report layer ends to us."""
        self.mem_pool_device.register_layer_transfer_counter(self.layer_done_counter)
        self.mem_pool_device.register_layer_backup_notifier(
            lambda layer_id: self.on_layer_end(layer_id, source="target")
        )

    # -- draft pools -------------------------------------------------------------------------------
    def attach_draft_pool(
        self, draft_mem_pool_device: KVCache | None, draft_mem_pool_host: HostKVCache | None
    ) -> None:
        """Attach a draft (speculative) pool pair; every later transfer carries it along."""
        if draft_mem_pool_device is None and draft_mem_pool_host is None:
            return
        device_pool = self._check_draft_attachable(draft_mem_pool_device, draft_mem_pool_host)
        assert draft_mem_pool_host is not None  # narrowed by _check_draft_attachable
        self.draft_mem_pool_device = device_pool
        self.draft_mem_pool_host = draft_mem_pool_host
        self.layer_done_counter.set_num_draft_layers(device_pool.layer_num)
        self._register_draft_hooks(device_pool)
        if not self.storage.uses_cp_hicache:  # its pages ride on the KV's slots into L3 too
            self.storage.add_sidecar_pool(DRAFT_POOL, draft_mem_pool_host)

    def _check_draft_attachable(
        self, draft_mem_pool_device: KVCache | None, draft_mem_pool_host: HostKVCache | None
    ) -> KVCache:
        """Refuse a draft pair that cannot be attached; returns the device pool it transfers."""
        from hicache_ref.pools.hybrid_pool import unwrap_full_kv_pool

        _check_draft_pair(draft_mem_pool_device, draft_mem_pool_host)
        assert draft_mem_pool_device is not None and draft_mem_pool_host is not None
        draft_mem_pool_device = unwrap_full_kv_pool(draft_mem_pool_device)
        if draft_mem_pool_host.page_size != self.page_size:
            raise HiCacheInputError(
                f"draft host pool page_size={draft_mem_pool_host.page_size} differs from "
                f"page_size={self.page_size}"
            )
        if not self.uses_cp_hicache and draft_mem_pool_host.size < self.mem_pool_host.size:
            raise HiCacheInputError(
                f"non-CP draft transfers reuse the target host slots, so the draft host pool "
                f"({draft_mem_pool_host.size} slots) must be at least as large as the target's "
                f"({self.mem_pool_host.size})"
            )
        if draft_mem_pool_device.layer_num < 1:
            raise HiCacheInputError("a draft device pool needs at least one layer")
        if self.ack_load_queue or self.load_queue:
            raise HiCacheInputError(
                "attach_draft_pool while loads are queued or undrained (attach before serving)"
            )
        return draft_mem_pool_device

    def _register_draft_hooks(self, draft_mem_pool_device: KVCache) -> None:
        draft_mem_pool_device.register_layer_transfer_counter(
            DraftLayerCounterView(self.layer_done_counter, self.device_module)
        )
        draft_mem_pool_device.register_layer_backup_notifier(
            lambda layer_id: self.on_layer_end(layer_id, source="draft")
        )

    def set_draft_kv_pool(self, draft_device_pool: KVCache, draft_host_pool: HostKVCache) -> None:
        """Register draft KV pools so L2 ops piggyback draft transfers (alias of attach)."""
        self.mem_pool_device_draft = draft_device_pool
        self.mem_pool_host_draft = draft_host_pool
        self.attach_draft_pool(draft_device_pool, draft_host_pool)
        logger.info(
            "HiCache draft KV registered: %s (host %d slots)",
            type(draft_device_pool).__name__,
            draft_host_pool.size,
        )

    def clear_draft_host_pool(self) -> None:
        if self.draft_mem_pool_host is not None:
            self.draft_mem_pool_host.clear()

    # -- write (D2H) -------------------------------------------------------------------------------
    def write(
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
    ) -> torch.Tensor | HiCacheWriteResult | HiCacheWriteFailure | None:
        """Back up ``device_indices`` to host; returns host indices, or None if the host is full."""
        if self.uses_cp_hicache:
            return self._write_cp(device_indices, priority, node_id)
        self._check_indices(device_indices, "device_indices", page_aligned=True)
        # Verify the node has no undrained write ack: a second one would ack it twice (INV-02)
        if node_id >= 0 and self.node_has_undrained_write_ack(node_id):
            raise InvariantViolation(
                "INV-02",
                f"write(node_id={node_id}) while its previous write ack is undrained "
                "(drain acks with writing_check before backing the node up again)",
            )
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        queued = len(self.write_queue), len(self.draft_write_queue)
        self.write_queue.append(CacheOperation(host_indices, device_indices, node_id, priority))
        if self.has_draft:
            self.draft_write_queue.append(
                CacheOperation(host_indices, device_indices, node_id, priority)
            )
        try:
            self.start_writing()
        except BaseException:
            # start_writing rolled itself back; undo this call's op and host slots (INV-17)
            self._dequeue_writes_from(*queued)
            self.mem_pool_host.free(host_indices)
            raise
        return host_indices

    def _dequeue_writes_from(self, target_len: int, draft_len: int) -> None:
        """Drop the write ops queued after the queues had these lengths."""
        del self.write_queue[target_len:]
        del self.draft_write_queue[draft_len:]

    def start_writing(self) -> None:
        """Issue every queued write as one fenced D2H on ``write_stream`` and append one ack."""
        if not self.write_queue and not self.draft_write_queue:
            return
        op = CacheOperation.merge_ops(self.write_queue) if self.write_queue else None
        draft_op = (
            CacheOperation.merge_ops(self.draft_write_queue) if self.draft_write_queue else None
        )
        node_ids = (op or draft_op).node_ids  # type: ignore[union-attr]
        host_indices = device_indices = draft_host = draft_device = None
        if op is not None:
            host_indices, device_indices = self.move_indices(op, self.mem_pool_host)
        if draft_op is not None:
            _, draft_host_pool = self._require_draft_pools()
            draft_host, draft_device = self.move_indices(draft_op, draft_host_pool)
        # A copy that fails to launch leaves queues, acks and the tracker as they were
        with rolled_back_on_failure(self, "start_writing", list(node_ids), self.write_stream):
            self._issue_write(node_ids, host_indices, device_indices, draft_host, draft_device)

    def _issue_write(
        self,
        node_ids: list[int],
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        """Dequeue, launch the fenced all-layer D2H, track it and append its one ack."""
        self.write_queue.clear()
        self.draft_write_queue.clear()
        start_event = self.device_module.Event()
        finish_event = self.device_module.Event()
        # Fence: the D2H must see every KV store already queued on the current stream (INV-12)
        start_event.record()
        if self.write_fence_stream is not None:
            self.write_stream.wait_stream(self.write_fence_stream)
        with self.device_module.stream(self.write_stream):
            start_event.wait(self.write_stream)
            if host_indices is not None and device_indices is not None:
                self.mem_pool_host.backup_from_device_all_layer(
                    self.mem_pool_device, host_indices, device_indices, self.io_backend
                )
            if draft_host is not None and draft_device is not None:
                draft_device_pool, draft_host_pool = self._require_draft_pools()
                draft_host_pool.backup_from_device_all_layer(
                    draft_device_pool, draft_host, draft_device, self.io_backend
                )
            finish_event.record()
            for tensor in (host_indices, device_indices, draft_host, draft_device):
                if tensor is not None and tensor.is_cuda:
                    self.device_module.record_stream(tensor, self.write_stream)
        self.inflight.add(
            "write",
            node_ids,
            finish_event,
            {
                "host": self._pages(host_indices),
                "device": self._pages(device_indices),
                "draft_host": self._draft_pages(draft_host),
                "draft_device": self._draft_pages(draft_device),
            },
        )
        self._append_write_ack(HiCacheAck(start_event, finish_event, list(node_ids)))

    # -- load (H2D) --------------------------------------------------------------------------------
    def load(
        self,
        host_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
    ) -> torch.Tensor | None:
        """Allocate device pages for ``host_indices`` and queue the H2D (``start_loading`` runs it)."""
        if self.uses_cp_hicache:
            raise HiCacheInputError(
                "load() on a CP controller would copy into logical locations of a physical pool; "
                "use load_cp(nodes) to replay the owner pattern"
            )
        self._check_indices(host_indices, "host_indices", page_aligned=True)
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(CacheOperation(host_indices, device_indices, node_id, priority))
        if self.has_draft and not self.uses_cp_hicache:
            self.draft_load_queue.append(
                CacheOperation(host_indices, device_indices, node_id, priority)
            )
        return device_indices

    def start_loading(self) -> int:
        """Issue every queued load layer by layer into a new producer slot; returns its id or -1."""
        if not self.load_queue and not self.draft_load_queue:
            return -1
        # Verify a producer slot is free: every undrained load ack holds one (INV-10)
        if len(self.ack_load_queue) >= self.layer_done_counter.num_counters:
            raise InvariantViolation(
                "INV-10",
                f"start_loading with {len(self.ack_load_queue)} undrained load acks and "
                f"num_counters={self.layer_done_counter.num_counters}: a slot would be reused while "
                "its ack is undrained (drain with loading_check first; upstream's "
                "has_free_load_back_slot)",
            )
        op = CacheOperation.merge_ops(self.load_queue) if self.load_queue else None
        draft_op = (
            CacheOperation.merge_ops(self.draft_load_queue) if self.draft_load_queue else None
        )
        node_ids = (op or draft_op).node_ids  # type: ignore[union-attr]
        host_indices = device_indices = draft_host = draft_device = None
        if op is not None:
            host_indices, device_indices = self.move_indices(op, self.mem_pool_host)
        if draft_op is not None:
            _, draft_host_pool = self._require_draft_pools()
            draft_host, draft_device = self.move_indices(draft_op, draft_host_pool)
        saved = take_checkpoint(self)
        producer_id = self.layer_done_counter.update_producer()
        # A copy that fails to launch gives the producer slot back and leaves queues as they were
        with rolled_back_on_failure(self, "start_loading", list(node_ids), self.load_stream, saved):
            self._issue_load(
                producer_id, node_ids, host_indices, device_indices, draft_host, draft_device
            )
        return producer_id

    def _issue_load(
        self,
        producer_id: int,
        node_ids: list[int],
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        """Dequeue, launch the per-layer H2D into slot ``producer_id``, track it, ack it."""
        # The slot's events are about to be re-recorded: forget transfers that finished on them
        # now, or the tracker would see the old load "in flight" again (a false INV-08).
        self.inflight.prune()
        self.load_queue.clear()
        self.draft_load_queue.clear()
        producer_event = self.layer_done_counter.events[producer_id]
        # Fence: pages being reused may still be written by queued forward work (sglang#36738)
        producer_event.start_event.record()
        if self.load_fence_stream is not None:
            self.load_stream.wait_stream(self.load_fence_stream)
        with self.device_module.stream(self.load_stream):
            producer_event.start_event.wait(self.load_stream)
            self._issue_load_layers(
                producer_event, host_indices, device_indices, draft_host, draft_device
            )
            for tensor in (host_indices, device_indices, draft_host, draft_device):
                if tensor is not None and tensor.is_cuda:
                    self.device_module.record_stream(tensor, self.load_stream)
        self.inflight.add(
            "load",
            node_ids,
            producer_event.finish_event,
            {
                "host": self._pages(host_indices),
                "device": self._pages(device_indices),
                "draft_host": self._draft_pages(draft_host),
                "draft_device": self._draft_pages(draft_device),
            },
        )
        self._append_load_ack(
            HiCacheAck(producer_event.start_event, producer_event.finish_event, list(node_ids))
        )

    def _issue_load_layers(
        self,
        producer_event: LayerLoadingEvent,
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        """On the load stream: H2D layer by layer, one event per layer, then the finish event."""
        draft_layers = self.draft_layer_num
        no_draft = draft_host is None or draft_device is None or not len(draft_host)
        if no_draft and self.layer_num > 0:
            # no draft copies: the same events in the same stream order as the loop below, and
            # the host pool may hand the target layers to the copy engine in one go
            if draft_layers > 0:
                producer_event.complete_draft(0)

            # after target layer i: its event, then draft layer i + 1's (one native call on a GPU)
            after_layer = producer_event.layer_records()
            if host_indices is not None and device_indices is not None and len(host_indices):
                self.mem_pool_host.load_to_device_layers(
                    self.mem_pool_device,
                    host_indices,
                    device_indices,
                    range(self.layer_num),
                    self.io_backend,
                    after_layer,
                )
            else:
                for i in range(self.layer_num):
                    after_layer(i)
            for i in range(self.layer_num + 1, draft_layers):
                producer_event.complete_draft(i)
            # The ack finishes only after the last target AND draft layer landed (INV-04)
            producer_event.finish_event.record()
            return
        for i in range(max(self.layer_num, draft_layers)):
            if i < draft_layers:
                if draft_host is not None and draft_device is not None and len(draft_host):
                    draft_device_pool, draft_host_pool = self._require_draft_pools()
                    draft_host_pool.load_to_device_per_layer(
                        draft_device_pool, draft_host, draft_device, i, self.io_backend
                    )
                producer_event.complete_draft(i)
            if i < self.layer_num:
                if host_indices is not None and device_indices is not None and len(host_indices):
                    self.mem_pool_host.load_to_device_per_layer(
                        self.mem_pool_device, host_indices, device_indices, i, self.io_backend
                    )
                producer_event.complete(i)
        # The ack finishes only after the last target AND draft layer landed (INV-04)
        producer_event.finish_event.record()

    # -- eviction ----------------------------------------------------------------------------------
    def evict_device(self, device_indices: torch.Tensor) -> int:
        """Free device pages; refused while a pending transfer still uses them (INV-08)."""
        self._check_indices(device_indices, "device_indices", page_aligned=False)
        physical = self._physical_pages(device_indices)
        self._check_no_pending_layer_write("device", device_indices, "evict_device", pages=physical)
        self.inflight.check_not_in_flight("device", physical, "INV-08", "evict_device")
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def _physical_pages(self, device_indices: torch.Tensor) -> frozenset[int]:
        """This rank's physical pages behind logical ``device_indices`` (transfers use these)."""
        layout = self.cp_shared_kv_layout
        if layout is None or device_indices.is_cuda or device_indices.numel() == 0:
            return self._pages(device_indices)
        values = get_small_cpu_values(device_indices)
        if values is not None:
            return layout.owned_physical_pages_of_list(values)
        owned = device_indices[layout.owned_by_this_rank(device_indices)]
        return self._pages(layout.logical_locs_to_physical(owned))

    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        """Free host slots; refused while a pending transfer still uses them (INV-07)."""
        if not backup_only:
            raise HiCacheInputError("evict_host supports backup_only=True only")
        self._check_indices(host_indices, "host_indices", page_aligned=True)
        self._check_no_pending_layer_write("host", host_indices, "evict_host")
        self.inflight.check_not_in_flight("host", self._pages(host_indices), "INV-07", "evict_host")
        self.mem_pool_host.free(host_indices)
        return len(host_indices)

    # -- reset -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every queue and ack; copies already issued finish first, so none lands later."""
        self.stop_event.set()
        # Let issued copies land before forgetting them: a copy landing after reset would write
        # into slots the tree is about to reuse (INV-18).
        self.write_stream.synchronize()
        self.load_stream.synchronize()
        self.write_queue.clear()
        self.load_queue.clear()
        self.draft_write_queue.clear()
        self.draft_load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self.pending_layer_writes.clear()
        self.inflight.clear()
        self.layer_done_counter.reset()
        # TreeNode ids restart at 0 after a tree reset; the empty queue makes the gate exact.
        self._max_write_ack_node_id = -1
        self.storage.reset()
        self.stop_event.clear()


def _check_draft_pair(device_pool: object, host_pool: object) -> None:
    """A draft device pool and its host pool come together or not at all."""
    if (device_pool is None) != (host_pool is None):
        raise DraftPoolPairError(
            "draft_mem_pool_device and draft_mem_pool_host must be provided together "
            f"(got device={device_pool is not None}, host={host_pool is not None})"
        )
