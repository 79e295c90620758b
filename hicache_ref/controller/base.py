"""State every part of the controller shares, and the checks on its inputs.

The write/load paths (``cache_controller.py``), the CP per-layer write-back (``cp_write.py``),
and the CP load (``cp_load.py``) are mixins over this state, so each file holds one concept and
they all see the same queues, streams and pools. The storage tier is an object of its own
(``controller/storage/``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from hicache_ref.controller.inflight import InflightTracker, pages_of
from hicache_ref.controller.operations import CacheOperation, HiCacheAck, LayerDoneCounter
from hicache_ref.device.protocol import DeviceModule, StreamT
from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError
from hicache_ref.pools.host_layout import LAYOUTS_BY_IO_BACKEND
from hicache_ref.pools.page_index import get_small_cpu_values, validate_page_aligned_token_indices

if TYPE_CHECKING:
    from hicache_ref.invariants.models import HiCacheLayerWriteState
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.device_pool import KVCache
    from hicache_ref.pools.host_pool import HostKVCache

logger = logging.getLogger("hicache_ref.controller")

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back", "write_behind")
IO_BACKENDS = ("direct", "kernel")
DIRECT_LAYOUTS = LAYOUTS_BY_IO_BACKEND["direct"]
KERNEL_LAYOUTS = LAYOUTS_BY_IO_BACKEND["kernel"]
"""The host layouts each io backend drives: one table, in ``pools/host_layout.py``."""

ACK_QUEUE_BOUND = 100_000
"""Upper bound on undrained acks per queue (TigerStyle: every queue has a bound it checks)."""


class ControllerState:
    """Attributes shared by the controller mixins (declared here for mypy --strict)."""

    device_module: DeviceModule
    mem_pool_device_allocator: PagedTokenToKVPoolAllocator
    mem_pool_device: KVCache
    mem_pool_host: HostKVCache
    draft_mem_pool_device: KVCache | None
    draft_mem_pool_host: HostKVCache | None
    cp_shared_kv_layout: CpSharedKVLayout | None
    uses_cp_hicache: bool
    page_size: int
    layer_num: int
    io_backend: str
    write_policy: str
    device: torch.device
    layer_done_counter: LayerDoneCounter
    write_stream: StreamT
    load_stream: StreamT
    load_queue: list[CacheOperation]
    write_queue: list[CacheOperation]
    draft_load_queue: list[CacheOperation]
    draft_write_queue: list[CacheOperation]
    ack_load_queue: list[HiCacheAck]
    ack_write_queue: list[HiCacheAck]
    pending_layer_writes: dict[int, HiCacheLayerWriteState]
    _max_write_ack_node_id: int
    inflight: InflightTracker
    stop_event: threading.Event

    # -- shared helpers ----------------------------------------------------------------------------
    @property
    def has_draft_hicache(self) -> bool:
        return self.draft_mem_pool_host is not None and self.draft_mem_pool_device is not None

    @property
    def has_draft(self) -> bool:
        """Whether draft transfers ride along (one flag; the seed kept two that could disagree)."""
        return self.has_draft_hicache

    @property
    def draft_layer_num(self) -> int:
        return self.draft_mem_pool_device.layer_num if self.draft_mem_pool_device is not None else 0

    def _require_draft_pools(self) -> tuple[KVCache, HostKVCache]:
        if self.draft_mem_pool_device is None or self.draft_mem_pool_host is None:
            raise HiCacheInputError("no draft pool attached (call attach_draft_pool first)")
        return self.draft_mem_pool_device, self.draft_mem_pool_host

    def _append_write_ack(self, ack: HiCacheAck) -> None:
        """The single funnel for ``ack_write_queue`` appends (keeps the undrained-ack gate exact)."""
        # Verify no node gets a second undrained write ack (INV-02, bug class 1)
        seen: set[int] = set()
        for node_id in ack.node_ids:
            if node_id < 0:
                continue
            if node_id in seen or self._scan_write_acks(node_id):
                raise InvariantViolation(
                    "INV-02",
                    f"a second write ack for node {node_id} while one is undrained "
                    "(drain it with writing_check before backing the node up again)",
                )
            seen.add(node_id)
        self._check_queue_bound(self.ack_write_queue, "ack_write_queue")
        self.ack_write_queue.append(ack)
        for node_id in ack.node_ids:
            self._max_write_ack_node_id = max(self._max_write_ack_node_id, node_id)

    def _append_load_ack(self, ack: HiCacheAck) -> None:
        self._check_queue_bound(self.ack_load_queue, "ack_load_queue")
        self.ack_load_queue.append(ack)

    def _append_completed_write_ack(self, node_id: int) -> None:
        event = self.device_module.Event()
        event.record()
        self._append_write_ack(HiCacheAck(event, event, [node_id]))

    def _append_completed_load_ack(self, node_id: int) -> None:
        event = self.device_module.Event()
        event.record()
        self._append_load_ack(HiCacheAck(event, event, [node_id]))

    def _scan_write_acks(self, node_id: int) -> bool:
        for ack in self.ack_write_queue:  # a plain loop: the gate asks for every live node
            if node_id in ack.node_ids:
                return True
        return False

    def node_has_undrained_write_ack(self, node_id: int) -> bool:
        """Whether a write ack for ``node_id`` is still in ``ack_write_queue`` (INV-02).

        Node ids only grow until ``reset()``, so an id above every queued id exits on one
        compare; older ids fall back to a scan of the queue.
        """
        if node_id > self._max_write_ack_node_id:
            return False
        return self._scan_write_acks(node_id)

    @staticmethod
    def _check_queue_bound(queue: list[Any], name: str) -> None:
        if len(queue) >= ACK_QUEUE_BOUND:
            raise InvariantViolation(
                "INV-16",
                f"{name} holds {ACK_QUEUE_BOUND} undrained acks: the tree is not draining them "
                "(call writing_check/loading_check every scheduler step)",
            )

    def _check_indices(self, indices: torch.Tensor, name: str, *, page_aligned: bool) -> None:
        """Reject malformed index tensors with a message naming the rule (never a bare assert)."""
        if not isinstance(indices, torch.Tensor):
            raise HiCacheInputError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
            raise HiCacheInputError(
                f"{name} must be a 1-D int64/int32 tensor, got shape {tuple(indices.shape)} "
                f"dtype {indices.dtype}"
            )
        if indices.is_cuda:
            return  # value checks would synchronize the stream; lengths are checked by callers
        values = get_small_cpu_values(indices)
        if values is None:
            lowest = int(indices.min()) if indices.numel() else 0
        else:
            lowest = min(values, default=0)
        if lowest < 0:
            raise HiCacheInputError(
                f"{name} contains negative index {lowest} (indices are slot numbers "
                ">= 0; sgl-kernel would silently skip it)"
            )
        if page_aligned:
            validate_page_aligned_token_indices(indices, self.page_size, name)

    def move_indices(
        self, op: CacheOperation, mem_pool_host: HostKVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Put an op's indices where the io backend reads them (CPU for our transfer planner).

        ``direct`` + ``layer_first`` sorts the host indices and permutes the device indices the
        same way, so contiguous host runs merge (the permutation must match: bug class 17).
        """
        pool = mem_pool_host or self.mem_pool_host
        host_indices, device_indices = op.host_indices, op.device_indices
        if self.io_backend == "kernel":
            return host_indices, device_indices
        if pool.layout == "layer_first":
            device_indices = device_indices.cpu()
            sorted_host, order = host_indices.sort()
            return sorted_host, device_indices.index_select(0, order.to(device_indices.device))
        if pool.layout in ("page_first_direct", "layer_page_first"):
            return host_indices, device_indices.cpu()  # whole pages, in the host's order
        raise UnknownOptionError(
            f"host layout {pool.layout!r} cannot be used with io_backend 'direct'; legal "
            f"layouts: {', '.join(DIRECT_LAYOUTS)}"
        )

    def start_writing(self) -> None:
        """Issue queued writes (defined by HiCacheController)."""

    def _check_no_pending_layer_write(
        self, pool: str, indices: torch.Tensor, action: str, *, pages: frozenset[int] | None = None
    ) -> None:
        """Refuse freeing slots a pending per-layer write still copies (INV-15, INV-08)."""
        pages = self._pages(indices) if pages is None else pages
        if not pages:
            return
        for node_id, state in self.pending_layer_writes.items():
            if pool == "device":
                held, inv_id = state.physical_device_indices, "INV-08"
            elif pool == "host":
                held, inv_id = state.host_indices, "INV-15"
            else:
                held, inv_id = state.draft_host_indices, "INV-15"
            if held is not None and self._pages(held) & pages:
                unit = "pages" if pool == "device" else "slots"
                raise InvariantViolation(
                    inv_id,
                    f"{action} frees {pool} {unit} of node {node_id} whose per-layer write is "
                    "still pending (cancel_layer_write_state(node_id) first)",
                )

    def _pages(self, indices: torch.Tensor | None) -> frozenset[int]:
        return pages_of(indices, self.page_size)

    def _draft_pages(self, indices: torch.Tensor | None) -> frozenset[int]:
        """Pages of the draft (or side) pool's indices, at that pool's page size: a draft pair
        pages like the anchor; a Mamba state pool's page is one slot."""
        host = self.draft_mem_pool_host
        return pages_of(indices, self.page_size if host is None else host.page_size)

    @staticmethod
    def _validate_options(write_policy: str, io_backend: str, layout: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise UnknownOptionError(
                f"unknown write_policy {write_policy!r}; legal values: {', '.join(WRITE_POLICIES)}"
            )
        if io_backend not in IO_BACKENDS:
            raise UnknownOptionError(
                f"unknown io_backend {io_backend!r}; legal values: {', '.join(IO_BACKENDS)}"
            )
        legal = DIRECT_LAYOUTS if io_backend == "direct" else KERNEL_LAYOUTS
        if layout not in legal:
            raise UnknownOptionError(
                f"host layout {layout!r} cannot be used with io_backend {io_backend!r}; "
                f"legal layouts for it: {', '.join(legal)}"
            )
