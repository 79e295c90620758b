"""An independent side pool: a second pool of a group with its own device rows and host slots.

Hybrid models cache a second kind of state beside the KV cache (sliding-window attention
rows, upstream 0.5.19+'s ``HostPoolGroup`` entry ``SWA``; a Mamba model's recurrent state, the
entry ``MAMBA``): its device rows come from its own allocator, its host slots from its own host
pool, and a node's rows and slots in it are never the anchor's (INV-36). An SWA pool holds a row
per token at the anchor's page size; a Mamba pool is a state pool: one state slot per node
(a page of one slot), backed up and loaded with the node's KV (INV-40). What a correct
controller does for it, in the order a node goes through:

- ``attach_side_pool``: the side pool's device pool, host pool and device allocator; its layers
  get their own load events (the reference's counterpart of upstream's transfer ids where the
  anchor's ``layer_mapper`` says None: a side layer's read waits on the side layer's event, never
  on an anchor layer's);
- ``write_with_side``: anchor host slots from the anchor's host pool, side host slots from the
  side pool's, all or nothing (a short side pool gives the anchor's slots back, INV-17); one
  fenced D2H of both pools and one ack;
- ``load_with_side``: anchor rows from the anchor's allocator, side rows from the side
  allocator, all or nothing; queued for ``start_loading``, which loads each pool's layers on
  their own events and finishes after the last of either (INV-04);
- ``evict_side_host``: the side host slots back to their own pool, refused while a queued copy
  still uses them (INV-07); the side rows go back to the side allocator by the caller, as the
  radix cache frees an SWA segment;
- ``SidePools``: the three calls above as the tree names them (``adapters/base.SidePoolsLike``);
- in L3: the storage tier stores the side pool's windows, a node's SWA pages (or its one Mamba
  state page, under its last page key) beside its KV pages under ``<key>.<pool>``, and reads a
  prefetch's window all-or-nothing with its KV (``controller/storage/side_window.py``, INV-39).

The side pool reuses the controller's draft queues, draft layer events and the ``draft_*`` pages
of the in-flight tracker, with its own indices; a controller with a side pool carries no draft
pair (``has_draft`` is False: nothing rides along on the anchor's indices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.base import ControllerState
from hicache_ref.controller.operations import CacheOperation, DraftLayerCounterView
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.pools.page_index import validate_page_aligned_token_indices

if TYPE_CHECKING:
    from hicache_ref.controller.storage.tier import StorageTier
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.device_pool import KVCache
    from hicache_ref.pools.host_pool import HostKVCache

SIDE_POOL_NAMES = ("swa", "mamba")
"""The independent side pools the reference holds (upstream's ``PoolName.SWA``, ``MAMBA``)."""
STATE_POOL_NAMES = ("mamba",)
"""Side pools with one state slot per node (their pages are single slots)."""


@dataclass(frozen=True)
class SidePool:
    """One independent side pool: its name, device pool, host pool and device allocator."""

    name: str
    device_pool: KVCache
    host_pool: HostKVCache
    allocator: PagedTokenToKVPoolAllocator

    @property
    def is_state_pool(self) -> bool:
        """One state slot per node (Mamba), not one row per token (SWA)."""
        return self.name in STATE_POOL_NAMES


class SidePoolMixin(ControllerState):
    """The controller's calls that name its independent side pool."""

    side_pool: SidePool | None = None
    side_pools: SidePools | None = None
    storage: StorageTier

    def attach_side_pool(
        self,
        device_pool: KVCache,
        host_pool: HostKVCache,
        allocator: PagedTokenToKVPoolAllocator,
        name: str = "swa",
    ) -> None:
        """Attach an independent side pool (before serving; no CP, no draft pair)."""
        if name not in SIDE_POOL_NAMES:
            raise HiCacheInputError(
                f"unknown side pool {name!r}; the reference holds {', '.join(SIDE_POOL_NAMES)}"
            )
        if self.uses_cp_hicache or self.draft_mem_pool_host is not None:
            raise HiCacheInputError(
                "a side pool is attached to a controller without CP and without a draft pair "
                "(its layers would share the draft events)"
            )
        page = 1 if name in STATE_POOL_NAMES else self.page_size  # a state pool: one slot
        if host_pool.page_size != page or allocator.page_size != page or device_pool.layer_num < 1:
            raise HiCacheInputError(
                f"side pool {name!r}: host and allocator page_size "
                f"{host_pool.page_size}/{allocator.page_size} must be {page} (a state pool's "
                "page is one slot, an SWA pool's the anchor's page), and its device pool needs "
                "at least one layer"
            )
        if allocator.get_kvcache() is not device_pool:
            raise HiCacheInputError(
                f"side pool {name!r}: its allocator must hand out rows of its own device pool "
                "(INV-36: a side pool's rows never come from another pool's allocator)"
            )
        if self.load_queue or self.ack_load_queue:
            raise HiCacheInputError("attach_side_pool while loads are queued or undrained")
        self.side_pool = SidePool(name, device_pool, host_pool, allocator)
        self.draft_mem_pool_device = device_pool
        self.draft_mem_pool_host = host_pool
        self.layer_done_counter.set_num_draft_layers(device_pool.layer_num)
        device_pool.register_layer_transfer_counter(
            DraftLayerCounterView(self.layer_done_counter, self.device_module)
        )
        self.side_pools = SidePools(self)
        self.storage.add_window_pool(name, host_pool)  # its windows in L3 (side_window.py)

    @property
    def has_draft(self) -> bool:
        """A draft pair rides along on the anchor's indices; a side pool never does."""
        return self.has_draft_hicache and self.side_pool is None

    def _require_side_pool(self) -> SidePool:
        if self.side_pool is None:
            raise HiCacheInputError("no side pool attached (call attach_side_pool first)")
        return self.side_pool

    def _check_side_indices(self, side: SidePool, indices: torch.Tensor, what: str) -> None:
        """A side pool's indices: whole pages of its own page size, and in a state pool exactly
        one state slot per node (INV-40: a node's state is one slot, never per token)."""
        self._check_indices(indices, f"{side.name} {what}", page_aligned=False)
        if side.is_state_pool:
            if len(indices) != 1:
                raise HiCacheInputError(
                    f"{side.name} {what}: a state pool holds one slot per node, got "
                    f"{len(indices)} (INV-40)"
                )
            return
        validate_page_aligned_token_indices(indices, self.page_size, f"{side.name} {what}")

    # -- seams: where each pool's rows and slots come from (INV-36) ----------------------------
    def _alloc_side_host(self, side: SidePool, tokens: int) -> torch.Tensor | None:
        return side.host_pool.alloc(tokens)

    def _alloc_side_device(self, side: SidePool, tokens: int) -> torch.Tensor | None:
        return side.allocator.alloc(tokens)

    # -- write ---------------------------------------------------------------------------------
    def write_with_side(
        self, device_indices: torch.Tensor, node_id: int, side_device: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Back up a node's anchor rows and side rows; (anchor slots, side slots) or None."""
        side = self._require_side_pool()
        self._check_indices(device_indices, "device_indices", page_aligned=True)
        self._check_side_indices(side, side_device, "device_indices")
        # Verify the node has no undrained write ack: a second one would ack it twice (INV-02)
        if node_id >= 0 and self.node_has_undrained_write_ack(node_id):
            raise InvariantViolation(
                "INV-02",
                f"write(node_id={node_id}) while its previous write ack is undrained "
                "(drain acks with writing_check before backing the node up again)",
            )
        host = self.mem_pool_host.alloc(len(device_indices))
        if host is None:
            return None
        side_host = self._alloc_side_host(side, len(side_device))
        if side_host is None:  # all or nothing: the anchor's slots go back (INV-17)
            self.mem_pool_host.free(host)
            return None
        queued = len(self.write_queue), len(self.draft_write_queue)
        self.write_queue.append(CacheOperation(host, device_indices, node_id))
        self.draft_write_queue.append(CacheOperation(side_host, side_device, node_id))
        try:
            self.start_writing()
        except BaseException:
            # start_writing rolled itself back; undo this call's ops and both pools' slots
            del self.write_queue[queued[0] :]
            del self.draft_write_queue[queued[1] :]
            side.host_pool.free(side_host)
            self.mem_pool_host.free(host)
            raise
        return host, side_host

    # -- load ----------------------------------------------------------------------------------
    def load_with_side(
        self,
        host_indices: torch.Tensor,
        node_id: int,
        side_host: torch.Tensor,
        request: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fresh rows of each pool's own allocator for a node's slots, queued for
        ``start_loading``; (anchor rows, side rows) or None (nothing held). ``request``: a
        state pool's slot the caller allocated for a request, loaded with the node's state
        too (a copy-on-write load; the caller keeps it, on a refusal too)."""
        side = self._require_side_pool()
        self._check_indices(host_indices, "host_indices", page_aligned=True)
        self._check_side_indices(side, side_host, "host_indices")
        if request is not None:
            if not side.is_state_pool:
                raise HiCacheInputError(
                    f"a request slot is loaded into a state pool only, not {side.name!r}"
                )
            self._check_side_indices(side, request, "request device_indices")
        device = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device is None:
            return None
        side_device = self._alloc_side_device(side, len(side_host))
        if side_device is None:  # all or nothing: the anchor's rows go back (INV-17)
            self.mem_pool_device_allocator.free(device)
            return None
        self.load_queue.append(CacheOperation(host_indices, device, node_id))
        self.draft_load_queue.append(CacheOperation(side_host, side_device, node_id))
        if request is not None:  # the same host state into the caller's slot
            self.draft_load_queue.append(CacheOperation(side_host, request, node_id))
        return device, side_device

    # -- host release --------------------------------------------------------------------------
    def evict_side_host(self, side_host: torch.Tensor) -> int:
        """Free side host slots; refused while a queued copy still uses them (INV-07)."""
        side = self._require_side_pool()
        self._check_side_indices(side, side_host, "host_indices")
        self._check_side_slots_idle(side_host)
        side.host_pool.free(side_host)
        return len(side_host)

    def _check_side_slots_idle(self, side_host: torch.Tensor) -> None:
        # Verify no unacked D2H writes and no H2D reads these side slots (INV-07)
        pages = self._draft_pages(side_host)  # at the side pool's own page size
        self.inflight.check_not_in_flight("draft_host", pages, "INV-07", "evict_side_host")


class SidePools:
    """The side pool as the tree names it (``SidePoolsLike``), over one controller."""

    def __init__(self, controller: SidePoolMixin) -> None:
        self._controller = controller

    def write(
        self, device_indices: torch.Tensor, node_id: int, side_device: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._controller.write_with_side(device_indices, node_id, side_device)

    def load(
        self,
        host_indices: torch.Tensor,
        node_id: int,
        side_host: torch.Tensor,
        request: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._controller.load_with_side(host_indices, node_id, side_host, request)

    def evict_host(self, side_host: torch.Tensor) -> None:
        self._controller.evict_side_host(side_host)
