"""Upstream 0.5.19+'s ``HybridCacheController``: the harness's pools as a ``HostPoolGroup``.

The hybrid controller takes a group of host pools instead of one pool: an *anchor* (the KV
pool, whose host indices every other pool may share) and side pools, each a ``PoolEntry``
with a ``layer_mapper`` from transfer layer ids to its own layers. The group class is
upstream's own (``pool_host/group.py``, run as it is); the entries hold this project's pools
behind the shims here, so every byte the harness checks is still in its own pools. In the
order ``build_group_controller`` assembles them (what upstream's ``hybrid_pool_assembler``
does for a KV-only stack):

- ``anchor``: the KV entry alone (``pool_group="anchor"``);
- ``packed``: the harness's draft pool as MTP drafts packed into the KV host pool
  (``PoolEntry.packed_draft_device_pools``): draft depth ``d`` is device layer ``d`` of the
  draft pool (``DraftLayerView``), host layer ``L + d`` of the KV entry. Upstream loads each
  depth at transfer layer ``min(d, L - 1)`` with ``is_draft=True``; ``PackedHostPoolShim`` keeps
  host layer ``L + d`` in the harness's draft host pool at the same slots;
- ``sidecar``: the draft pool as the ``DRAFT`` side entry whose transfers ride on the KV
  indices (``PoolTransfer(indices_from_pool=KV)``, upstream's ``DRAFT_SWA`` pattern); the tree
  names it on every ``write`` and ``load`` (as upstream's radix cache builds ``extra_pools``),
  and transfer ids span ``max(L, draft layers)`` with holes where a pool has no layer;
- ``mamba``: the same, as the ``MAMBA`` entry of a state pool (one slot per node, pages of
  one slot: ``HarnessConfig.side_page_size``); the entry's host pool is the harness's own,
  in place of upstream's ``MambaPoolHost`` (whose copies need sgl_kernel);
- ``swa``: the draft pool as an independent ``SWA`` side entry: its own device rows
  (``device_alloc_fn`` / ``device_free_fn``: the world's side allocator), its own host slots
  (its host pool's allocator, resolved by ``HostPoolGroup.resolve_host_transfers``), its
  layers between the anchor's in the transfer ids (``world/side_pools.SideLayout``: the
  anchor's ``layer_mapper`` is None there). The tree names it through ``side_pools``
  (``sglang_sides.py``), and each device pool waits by its layers' transfer ids.

After construction the assembler's wiring: the controller's layer counter on the KV device
pool (and on a sidecar's, whose reads wait on their own transfer ids); a packed draft's reads
are ordered after the target forward (``sglang_shapes.AfterTargetForward``), since upstream
registers no counter on draft pools.
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import BuildRequest
from hicache_ref.harness.adapters.sglang_shapes import AfterTargetForward, L2HostPoolShim
from hicache_ref.harness.adapters.sglang_sides import SglangSidePools, side_pool_name
from hicache_ref.harness.world.side_pools import MappedCounter, side_layout


class DraftLayerView:
    """One packed MTP draft: device layer ``depth`` of the harness's draft device pool."""

    layer_num = 1

    def __init__(self, pool: Any, depth: int) -> None:
        self.pool = pool
        self.depth = depth


class GroupHostPoolShim(L2HostPoolShim):
    """A host pool as a ``PoolEntry`` holds it: no write-back JIT, no shared layout domain."""

    can_use_write_back_jit = False
    shared_allocation_domain = None
    stores_page_envelope = False


class StatePoolShim(GroupHostPoolShim):
    """The harness's Mamba state pool as the group's ``MAMBA`` entry (in place of upstream's
    ``MambaPoolHost``): a state copy pairs each slot it writes with one slot it reads, so a copy
    of a node's state moves exactly its one slot each way. A backup writes distinct host slots,
    one per device slot; a load writes distinct device slots, one per host slot (a host slot may
    repeat: a copy-on-write load reads a node's host state into its own slot and a request's).
    A copy whose slots do not pair (more slots written than read, or one written twice) is a
    state counted per token: the one checker of INV-40 judges it before any byte moves (the
    harness's pool would otherwise fail on the shapes). While the tree backs a node up (``node_slots``: the state
    slots the node holds, set by ``SglangSidePools.write``) the host slots the group allocates
    here are judged the same way, before upstream moves or sorts them."""

    node_slots: int | None = None

    def alloc(self, need_size: int, **kwargs: Any) -> Any:
        from hicache_ref.invariants.evidence import StateSlots
        from hicache_ref.invariants.registry import REGISTERED

        indices = self._pool.alloc(need_size, **kwargs)
        if indices is not None and self.node_slots is not None:
            what = f"the MAMBA entry's host allocation for a node of {self.node_slots} slot(s)"
            REGISTERED["INV-40"](StateSlots("side host", indices, self.node_slots, what))
        return indices

    def _check_pairs(self, host_indices: Any, device_indices: Any, verb: str) -> None:
        from hicache_ref.invariants.evidence import StateSlots
        from hicache_ref.invariants.registry import REGISTERED

        if verb == "backup":  # the host slots written, one per device slot read
            what = f"the MAMBA entry's backup of {len(device_indices)} device state slot(s)"
            evidence = StateSlots("side host", host_indices, len(device_indices), what)
        else:  # the device slots written, one per host slot read (host slots may repeat)
            what = f"the MAMBA entry's load of {len(host_indices)} host state slot(s)"
            evidence = StateSlots("side device", device_indices, len(host_indices), what)
        REGISTERED["INV-40"](evidence)

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: str
    ) -> None:
        self._check_pairs(host_indices, device_indices, "backup")
        self._pool.backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        self._check_pairs(host_indices, device_indices, "load")
        self._pool.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend
        )


class PackedHostPoolShim(GroupHostPoolShim):
    """The KV host pool with packed draft layers: host layer ``L + d`` is draft depth ``d``,
    kept in the harness's draft host pool at the same slots (upstream's packed pool holds them
    in one buffer). A D2H of the anchor backs up the draft layers too, as upstream's does."""

    def __init__(self, pool: Any, draft_device_pool: Any, draft_host_pool: Any) -> None:
        super().__init__(pool)
        self._draft_device_pool = draft_device_pool
        self._draft_host_pool = draft_host_pool

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: str
    ) -> None:
        self._pool.backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )
        self._draft_host_pool.backup_from_device_all_layer(
            self._draft_device_pool, host_indices, device_indices, io_backend
        )

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        if not isinstance(device_pool, DraftLayerView):
            self._pool.load_to_device_per_layer(
                device_pool, host_indices, device_indices, layer_id, io_backend
            )
            return
        target_layers = int(self._pool.layer_num)
        # Verify the draft depth is loaded from its own packed host layer (L + depth)
        if not is_draft or layer_id != target_layers + device_pool.depth:
            raise InvariantViolation(
                "INV-06",
                f"packed draft depth {device_pool.depth} loaded from host layer {layer_id} "
                f"(is_draft={is_draft}); its bytes live in host layer "
                f"{target_layers + device_pool.depth}, loaded with is_draft=True",
            )
        self._draft_host_pool.load_to_device_per_layer(
            device_pool.pool, host_indices, device_indices, device_pool.depth, io_backend
        )


def _layer_mapper(layers: range, bound: int) -> Callable[[int], int | None]:
    """Transfer layer id -> the pool's layer (identity over ``layers``; None in the holes)."""

    def mapper(layer_id: int) -> int | None:
        if not 0 <= layer_id < bound:
            return None
        return layer_id if layer_id in layers else None

    return mapper


def build_group_controller(
    hybrid: types.ModuleType,
    request: BuildRequest,
    allocator: Any,
    io_backend: str,
    storage_class: type[Any] | None = None,
) -> Any:
    """A ``HybridCacheController`` over the harness's pools grouped as ``config.pool_group``;
    in a storage world ``storage_class`` (``sglang_storage.storage_controller_class``: upstream's
    hybrid controller, its storage threads served step by step) instead."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # type: ignore
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # type: ignore

    config = request.config
    target_layers, draft_layers = config.layer_num, config.draft_layer_num
    draft_device, draft_host = request.draft_device_pool, request.draft_host_pool
    device_pool = request.allocator.get_kvcache()
    if hasattr(device_pool, "full_kv_pool"):  # a hybrid pool: the controller unwraps it too
        device_pool = device_pool.full_kv_pool
    transfer_layers = target_layers
    entries = []
    if config.pool_group == "packed":
        assert draft_device is not None and draft_host is not None
        depths = range(draft_layers)
        host_layers = range(target_layers + draft_layers)  # the packed mapping of 0.5.23
        entries.append(
            PoolEntry(
                name=PoolName.KV,
                host_pool=PackedHostPoolShim(request.host_pool, draft_device, draft_host),
                device_pool=device_pool,
                layer_mapper=_layer_mapper(host_layers, len(host_layers)),
                is_primary_index_anchor=True,
                packed_draft_device_pools=tuple(DraftLayerView(draft_device, d) for d in depths),
            )
        )
    elif config.has_side_pools:
        layout = side_layout(config)
        transfer_layers = layout.total
        entries.append(
            PoolEntry(
                name=PoolName.KV,
                host_pool=GroupHostPoolShim(request.host_pool),
                device_pool=device_pool,
                layer_mapper=layout.mapper(side=False),
                is_primary_index_anchor=True,
            )
        )
        side_allocator = request.side_allocator
        assert draft_device is not None and draft_host is not None and side_allocator is not None
        entries.append(
            PoolEntry(
                # the SWA entry, or the MAMBA one (a state pool: one slot per node; the
                # harness's own pool in place of upstream's MambaPoolHost, whose copies are
                # sgl_kernel / triton kernels)
                name=side_pool_name(PoolName, config.pool_group),
                host_pool=(StatePoolShim if config.has_state_pool else GroupHostPoolShim)(
                    draft_host
                ),
                device_pool=draft_device,
                layer_mapper=layout.mapper(side=True),
                device_alloc_fn=side_allocator.alloc,
                device_free_fn=side_allocator.free,
            )
        )
    else:
        if config.pool_group == "sidecar":
            transfer_layers = max(target_layers, draft_layers)
        entries.append(
            PoolEntry(
                name=PoolName.KV,
                host_pool=GroupHostPoolShim(request.host_pool),
                device_pool=device_pool,
                layer_mapper=_layer_mapper(range(target_layers), transfer_layers),
                is_primary_index_anchor=True,
            )
        )
    if config.pool_group == "sidecar":
        assert draft_device is not None and draft_host is not None
        entries.append(
            PoolEntry(
                name=PoolName.DRAFT,
                host_pool=GroupHostPoolShim(draft_host),
                device_pool=draft_device,
                layer_mapper=_layer_mapper(range(draft_layers), transfer_layers),
            )
        )
    controller_class = hybrid.HybridCacheController
    # 0.5.19 - 0.5.20 call the transfer bound transfer_layer_num, 0.5.21+ transfer_layer_id_max
    parameters = inspect.signature(controller_class.__init__).parameters
    bound = (
        "transfer_layer_id_max" if "transfer_layer_id_max" in parameters else "transfer_layer_num"
    )
    storage: dict[str, Any] = {}
    if storage_class is not None:
        controller_class = storage_class
        storage = {
            "collectives": request.storage_collectives,
            "schedule_points": config.storage_points,
            "page_points": config.storage_page_points,
        }
        if config.storage_pp:  # PP ranks in buffer_only mode: 0.5.23's PP prefetch tickets
            storage["pp"] = True
        if config.storage_buffer_only:  # host memory as staging (the buffer pipeline's tree)
            storage["buffer_only"] = True
        if config.storage_swa_window:  # the side pool's window (a Mamba state) goes to L3
            storage["swa_window"] = config.storage_swa_window
            storage["side_pool"] = config.pool_group
    controller = controller_class(
        allocator,
        HostPoolGroup(entries),
        config.page_size,
        None,  # tp_group: TP 1 without storage (a storage class hands upstream its group)
        threading.Event(),
        write_policy="write_through",
        io_backend=io_backend,
        **{bound: transfer_layers},
        **storage,
    )
    counter = controller.layer_done_counter
    if config.has_side_pools:  # each pool's forward waits by its layers' transfer ids
        assert draft_device is not None
        layout = side_layout(config)
        device_pool.register_layer_transfer_counter(MappedCounter(counter, layout, side=False))
        draft_device.register_layer_transfer_counter(MappedCounter(counter, layout, side=True))
        controller.side_pools = SglangSidePools(
            controller, PoolTransfer, side_pool_name(PoolName, config.pool_group)
        )
        return controller
    device_pool.register_layer_transfer_counter(counter)  # the assembler re-registers it
    if config.pool_group == "packed":
        assert draft_device is not None
        draft_device.register_layer_transfer_counter(AfterTargetForward(counter, target_layers))
    if config.pool_group == "sidecar":
        assert draft_device is not None
        draft_device.register_layer_transfer_counter(counter)
        _name_sidecar_on_every_transfer(controller, PoolTransfer, PoolName)
    return controller


def _name_sidecar_on_every_transfer(controller: Any, pool_transfer: Any, names: Any) -> None:
    """The tree's side of a sidecar: every ``write`` and ``load`` names the ``DRAFT`` pool,
    riding on the KV indices (what upstream's radix cache passes as ``extra_pools``)."""
    write, load = controller.write, controller.load

    def sidecar() -> list[Any]:
        return [pool_transfer(name=names.DRAFT, indices_from_pool=names.KV)]

    def write_with_sidecar(device_indices: Any, priority: Any = None, node_id: int = -1) -> Any:
        return write(device_indices, priority, node_id, extra_pools=sidecar())

    def load_with_sidecar(host_indices: Any, priority: Any = None, node_id: int = -1) -> Any:
        return load(host_indices, priority, node_id, extra_pools=sidecar())

    controller.write = write_with_sidecar
    controller.load = load_with_sidecar
