"""The tree-side driver: what SGLang's radix cache does around the controller, written once.

It owns the radix nodes (here a flat table: the harness needs lifecycles, not prefix matching),
locks a node before its backup, drains only a FIFO prefix of completed acks (MIN over CP ranks),
unlocks per node id, pins a loading node until its ack, sets the consumer slot before a forward
read, and evicts host copies only when no op reads them. The state machines and the trace
replayer both drive the controller through this class, and every rule returns a short outcome
string so a trace says what happened.

Node lifecycle (specs/protocol.md): computing -> device -> backing_up -> backed_up ->
evicted (host only) -> loading -> backed_up; a node never backed up can be dropped.

The driver calls implementations only through the contract of ``adapters/base.py`` and trusts
none of their bookkeeping: where a node's bytes live on each rank (owned positions, padding,
page owners) is computed from the harness's own CP layout; from the implementation it takes only
the host slots it chose, and checks their number (INV-13). Without ``per_layer_write`` CP
backups go through ``submit_write_cp_all_layer`` and nothing is reserved early.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import (
    AckQueue,
    ControllerLike,
    CpControllerLike,
    CpMetadataLike,
    PerLayerWriteLike,
    WriteReservationLike,
    as_reservation,
    is_write_failure,
)
from hicache_ref.harness.content import FREED_ROW_VALUE, describe_row, expected_rows
from hicache_ref.harness.world import World
from hicache_ref.invariants.checks_acks import check_ack_rows_identical
from hicache_ref.invariants.checks_layout import check_host_slot_count, check_owner_replay
from hicache_ref.invariants.checks_transfer import check_bytes_equal
from hicache_ref.invariants.snapshot import HarnessModel, NodeHoldings
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.host_pool import HostKVCache


@dataclass
class Node:
    handle: int
    node_id: int
    logical_len: int
    value: torch.Tensor | None  # logical device locs [:logical_len], identical on every rank
    layers_stored: int = 0
    backup: str = "none"  # none | in_flight | done
    host_value: list[torch.Tensor | None] = field(default_factory=list)  # non-CP, per rank
    cp_meta: list[CpMetadataLike | None] = field(default_factory=list)  # CP, per rank
    reservations: list[WriteReservationLike] = field(default_factory=list)  # CP, per rank
    # recorded by the harness at write time, from its own CP layout (never the metadata's):
    page_owners: list[int] = field(default_factory=list)  # owner rank of each padded page
    owned_positions: list[torch.Tensor] = field(default_factory=list)  # per rank, padded span
    loading: bool = False
    producer_id: int | None = None
    pending_reads: int = 0
    # caches of what the harness derives from ``value`` (rebuilt when ``value`` is replaced)
    placement_of: torch.Tensor | None = field(default=None, repr=False)
    placement: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )  # rank -> (owned positions, physical locs)
    rows_positions: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    rows_cache: dict[tuple[int, bool, int, int, tuple[int, ...]], torch.Tensor] = field(
        default_factory=dict, repr=False
    )  # (rank, draft, layer, component, row shape) -> the oracle's rows at ``rows_positions``
    host_rows_of: list[torch.Tensor] | None = field(default=None, repr=False)
    host_rows_cache: dict[tuple[int, bool, int, int, tuple[int, ...]], torch.Tensor] = field(
        default_factory=dict, repr=False
    )  # the same key -> the oracle's rows at the host positions of ``owned_positions``
    holdings_key: tuple[object, ...] | None = field(default=None, repr=False)
    holdings: NodeHoldings | None = field(default=None, repr=False)

    @property
    def on_device(self) -> bool:
        return self.value is not None


@dataclass
class _CpNodeView:
    """What ``load_cp`` reads from a node (id, host_len, cp_hicache) for one rank."""

    id: int
    host_len: int
    cp_hicache: CpMetadataLike


class TreeDriver:
    """Drives every rank's controller in lockstep, as the radix cache and scheduler would."""

    def __init__(self, world: World, checks: Counter[str] | None = None) -> None:
        self.world = world
        self.config = world.config
        self.checks: Counter[str] = Counter() if checks is None else checks  # runs per id
        self.nodes: dict[int, Node] = {}
        self.next_handle = 0
        self.next_node_id = 0
        self.ongoing_write: dict[int, int] = {}  # node_id -> handle
        self.ongoing_load: dict[int, int] = {}
        self.queued_loads: list[int] = []  # handles loaded but not yet started
        self.acked_writes = 0
        self.batch: list[int] = []  # nodes of the forward batch being computed
        self.batch_layer = 0  # the next layer that batch stores
        self.acked_loads = 0

    # -- helpers -------------------------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        return max(self.config.layer_num, self.config.draft_layer_num)

    def node(self, handle: int) -> Node | None:
        return self.nodes.get(handle)

    def handles(self, predicate: Callable[[Node], bool]) -> list[int]:
        return sorted(h for h, n in self.nodes.items() if predicate(n))

    def _controllers(self) -> list[ControllerLike]:
        return [rank.controller for rank in self.world.ranks]

    def _cp_controllers(self) -> list[CpControllerLike]:
        """Every rank's controller as the CP contract (only on a CP world)."""
        out = [rank.cp for rank in self.world.ranks]
        assert all(c is not None for c in out), "CP verbs on a world without CP"
        return [c for c in out if c is not None]

    def _per_layer_controllers(self) -> list[PerLayerWriteLike]:
        """Every rank's controller as the per-layer contract (empty without per_layer_write)."""
        return [rank.per_layer for rank in self.world.ranks if rank.per_layer is not None]

    def _meta(self, node: Node, rank: int) -> CpMetadataLike:
        meta = node.cp_meta[rank]
        assert meta is not None, f"node {node.handle} has no CP metadata on rank {rank}"
        return meta

    def _owned_positions(self, rank: int, node: Node, locs: torch.Tensor) -> torch.Tensor:
        """Positions (< logical_len) of ``locs`` whose page this rank owns (all when no CP)."""
        positions = torch.arange(node.logical_len)
        if not self.config.uses_cp:
            return positions
        layout = self.world.ranks[rank].cp_layout
        assert layout is not None
        mask = layout.owned_by_this_rank(locs[: node.logical_len])
        return positions[mask]

    def _placement(self, rank: int, node: Node) -> tuple[torch.Tensor, torch.Tensor]:
        """(owned positions, physical locs) of the node's device copy on ``rank``.

        Computed from the harness's own layout once per ``node.value`` (a node's device locs
        never change in place; ``load_back`` replaces the tensor), not once per store or read.
        """
        value = node.value
        assert value is not None
        if node.placement_of is not value:
            node.placement_of, node.placement = value, {}
        hit = node.placement.get(rank)
        if hit is None:
            positions = self._owned_positions(rank, node, value)
            old = node.rows_positions.get(rank)
            if old is None or not torch.equal(old, positions):
                # the oracle's rows depend only on the positions: keep them across a reload
                # that owns the same positions (always, without CP)
                node.rows_positions[rank] = positions
                node.rows_cache = {k: v for k, v in node.rows_cache.items() if k[0] != rank}
            hit = (positions, self._physical(rank, value[positions]))
            node.placement[rank] = hit
        return hit

    def _device_rows(
        self,
        rank: int,
        node: Node,
        draft: bool,
        layer: int,
        component: int,
        row_shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The content oracle's rows for the node's positions on ``rank`` (cached; read only)."""
        positions, _ = self._placement(rank, node)
        key = (rank, draft, layer, component, row_shape)
        rows = node.rows_cache.get(key)
        if rows is None:
            rows = expected_rows(node.handle, draft, layer, component, positions, row_shape)
            node.rows_cache[key] = rows
        return rows

    def _physical(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        layout = self.world.ranks[rank].cp_layout
        if layout is None:
            return locs
        physical: torch.Tensor = layout.logical_locs_to_physical(locs)
        return physical

    def _pools(self, rank: int, draft: bool) -> tuple[KVCache, HostKVCache]:
        r = self.world.ranks[rank]
        if not draft:
            return r.device_pool, r.host_pool
        assert r.draft_device_pool is not None and r.draft_host_pool is not None
        return r.draft_device_pool, r.draft_host_pool

    def _padded_locs(self, locs: torch.Tensor) -> torch.Tensor:
        """``locs`` padded to whole pages, as the harness pads them (each page is contiguous)."""
        page = self.config.page_size
        pages = torch.div(locs[::page], page, rounding_mode="floor")
        return (pages[:, None] * page + torch.arange(page)).reshape(-1)

    def _record_layout(self, node: Node) -> None:
        """Record, from the harness's CP layout, each page's owner and each rank's positions."""
        assert node.value is not None
        page = self.config.page_size
        padded = self._padded_locs(node.value)
        node.owned_positions = []
        for rank in self.world.ranks:
            assert rank.cp_layout is not None
            mask = rank.cp_layout.owned_by_this_rank(padded)
            node.owned_positions.append(mask.nonzero(as_tuple=True)[0])
        layout = self.world.ranks[0].cp_layout
        assert layout is not None
        pages = torch.div(padded[::page], page, rounding_mode="floor")
        node.page_owners = [int(o) for o in layout.owner_for_logical_pages(pages).tolist()]

    def _count(self, inv_id: str) -> None:
        self.checks[inv_id] += 1

    def _layer_kinds(self) -> list[tuple[bool, int]]:
        kinds = [(False, self.config.layer_num)]
        if self.config.has_draft:
            kinds.append((True, self.config.draft_layer_num))
        return kinds

    # -- prefill and the forward pass ----------------------------------------------------------
    def prefill(
        self, num_tokens: int, early_reserve: bool, handle: int | None = None, batch: bool = True
    ) -> str:
        """Allocate a new node's pages; its KV is stored layer by layer by ``forward_layer``."""
        handle = self.next_handle if handle is None else handle
        self.next_handle = max(self.next_handle, handle) + 1  # consumed even when refused
        page = self.config.page_size
        logical_len = num_tokens if self.config.uses_cp else -(-num_tokens // page) * page
        padded_len = -(-logical_len // page) * page
        if self.batch_layer > 0:
            return "refused: a forward batch is mid-way (it finishes first)"
        allocs = [rank.allocator.alloc(padded_len) for rank in self.world.ranks]
        if any(a is None for a in allocs):
            for a, rank in zip(allocs, self.world.ranks, strict=True):
                if a is not None:
                    rank.allocator.free(a)
            return "refused: device full"
        first = allocs[0]
        assert first is not None
        for other in allocs[1:]:
            if other is None or not torch.equal(other, first):
                raise InvariantViolation(
                    "INV-14", "CP ranks' allocators handed out different logical pages"
                )
        node = Node(
            handle=handle,
            node_id=self.next_node_id,
            logical_len=logical_len,
            value=first[:logical_len].clone(),
        )
        self.next_node_id += 1
        node.host_value = [None] * len(self.world.ranks)
        node.cp_meta = [None] * len(self.world.ranks)
        self.nodes[handle] = node
        if batch:  # else the node's layers are stored one by one with store_layer
            self.batch.append(handle)
        if early_reserve and self.config.uses_cp and self.world.per_layer_write:
            outcome = self._reserve_cp(node, catch_up=False)
            return f"node {handle} ({logical_len} tokens); {outcome}"
        return f"node {handle} ({logical_len} tokens)"

    def forward_layer(self) -> str:
        """One layer of the forward batch: queue every batch node's KV store, then the hooks.

        All nodes prefilled together form one batch (a forward pass computes them together),
        so a layer-end hook fires only after that layer was stored for every pending node.
        """
        batch = [self.nodes[h] for h in self.batch]
        layer = self.batch_layer
        assert batch and layer < self.total_layers
        for draft, layer_num in self._layer_kinds():
            if layer >= layer_num:
                continue
            for node in batch:
                if node.value is None:
                    continue
                for rank in range(len(self.world.ranks)):
                    self._enqueue_store(rank, node, draft, layer)
            for rank in range(len(self.world.ranks)):
                pool, _ = self._pools(rank, draft)
                pool.notify_layer_end(layer)
        for node in batch:
            node.layers_stored = layer + 1
        self.batch_layer += 1
        if self.batch_layer == self.total_layers:
            self.batch, self.batch_layer = [], 0
        return f"stored layer {layer} of nodes {[n.handle for n in batch]}"

    def store_layer(self, handle: int, layer: int, draft: bool) -> str:
        """Queue one layer's KV store of one node (fine-grained; oracle traces use it)."""
        node = self.nodes[handle]
        for rank in range(len(self.world.ranks)):
            self._enqueue_store(rank, node, draft, layer)
        if not draft or self.config.draft_layer_num >= self.config.layer_num:
            node.layers_stored = max(node.layers_stored, layer + 1)
        return f"stored {'draft' if draft else 'target'} layer {layer} of node {handle}"

    def layer_end(self, layer: int, draft: bool) -> str:
        """The device pools' layer-end hooks for ``layer`` (drives pending per-layer writes)."""
        for rank in range(len(self.world.ranks)):
            pool, _ = self._pools(rank, draft)
            pool.notify_layer_end(layer)
        return f"layer_end {layer} ({'draft' if draft else 'target'})"

    def reserve(self, handle: int) -> str:
        """Early CP reservation of an existing node (catch_up_all_layers=False)."""
        return self._reserve_cp(self.nodes[handle], catch_up=False)

    def submit_layer(self, handle: int, layer: int, draft: bool) -> str:
        node = self.nodes[handle]
        controllers = self._per_layer_controllers()
        for controller, reservation in zip(controllers, node.reservations, strict=True):
            controller.submit_write_cp_layer(
                reservation, layer, submit_target=not draft, submit_draft=draft
            )
        return f"submit {'draft' if draft else 'target'} layer {layer} of node {handle}"

    def _enqueue_store(self, rank: int, node: Node, draft: bool, layer: int) -> None:
        assert node.value is not None
        pool, _ = self._pools(rank, draft)
        _, locs = self._placement(rank, node)
        buffers = pool.layer_buffers(layer)
        payload = [
            self._device_rows(rank, node, draft, layer, c, tuple(buf.shape[1:]))
            for c, buf in enumerate(buffers)
        ]

        def store() -> None:
            for buf, rows in zip(buffers, payload, strict=True):
                buf[locs] = rows.to(buf.device, non_blocking=True)

        self.world.device.launch(store, label=f"store n{node.handle} L{layer}", kind="kernel")

    def forward_read(self, handle: int, layer: int, draft: bool) -> str:
        """The forward reads one layer of the node: wait on the consumer slot, then check bytes."""
        node = self.nodes[handle]
        assert node.value is not None
        consumer = node.producer_id if node.loading and node.producer_id is not None else -1
        for rank_index, rank in enumerate(self.world.ranks):
            rank.controller.layer_done_counter.set_consumer(consumer)
            pool, _ = self._pools(rank_index, draft)
            pool.get_key_buffer(layer)  # waits until this layer landed (INV-11)
            _, locs = self._placement(rank_index, node)
            buffers = pool.layer_buffers(layer)
            expected = [
                self._device_rows(rank_index, node, draft, layer, c, tuple(buf.shape[1:]))
                for c, buf in enumerate(buffers)
            ]
            node.pending_reads += 1

            def read(
                buffers: list[torch.Tensor] = buffers,
                expected: list[torch.Tensor] = expected,
                locs: torch.Tensor = locs,
                rank_index: int = rank_index,
            ) -> None:
                node.pending_reads -= 1
                for c, (buf, rows) in enumerate(zip(buffers, expected, strict=True)):
                    self._check_rows(
                        buf[locs],
                        rows,
                        "INV-11",
                        f"forward read of node {handle} {'draft' if draft else 'target'} "
                        f"layer {layer} component {c} on rank {rank_index}",
                    )

            self.world.device.launch(read, label=f"read n{handle} L{layer}", kind="kernel")
        for rank in self.world.ranks:
            rank.controller.layer_done_counter.set_consumer(-1)
        return f"read layer {layer} of node {handle}"

    # -- write back ----------------------------------------------------------------------------
    def write_backup(self, handle: int) -> str:
        node = self.nodes[handle]
        assert node.value is not None and node.backup == "none"
        if self.config.uses_cp:
            return self._reserve_cp(node, catch_up=True)
        host = self.world.ranks[0].controller.write(node.value, node_id=node.node_id)
        if host is None:
            return "refused: host full"
        assert isinstance(host, torch.Tensor), "a non-CP write returns host indices or None"
        node.host_value[0] = host
        self._start_backup(node)
        return f"write node {handle} -> host {host.numel()} slots"

    def _reserve_cp(self, node: Node, *, catch_up: bool) -> str:
        """Reserve on every rank, agree, then submit: a rank-local failure must not ack alone."""
        assert node.value is not None
        assert catch_up or self.world.per_layer_write, "early reservations need per_layer_write"
        controllers = self._cp_controllers()
        results = [c.reserve_write_cp(node.value, node_id=node.node_id) for c in controllers]
        reservations = [as_reservation(r) for r in results]
        if any(r is None for r in reservations):
            for controller, reservation in zip(controllers, reservations, strict=True):
                if reservation is not None:
                    controller.evict_cp_host(reservation.metadata)
            reasons = sorted({r.reason for r in results if is_write_failure(r)})
            return f"refused: {', '.join(reasons)}"
        held = [r for r in reservations if r is not None]
        node.cp_meta = [r.metadata for r in held]
        self._record_layout(node)
        for rank_index in range(len(controllers)):
            for draft in self._host_copies():
                self._host_slots(rank_index, node, draft)  # Verify the slot counts (INV-13)
        per_layer = self._per_layer_controllers()
        for rank_index, reservation in enumerate(held):
            if per_layer:
                per_layer[rank_index].submit_write_cp_per_layer(
                    reservation, catch_up_all_layers=catch_up
                )
            else:  # no per_layer_write: one all-layer D2H per rank
                controllers[rank_index].submit_write_cp_all_layer(reservation)
        node.reservations = held
        self._start_backup(node)
        return f"reserve node {handle_of(node)} on {len(results)} rank(s)"

    def _host_copies(self) -> list[bool]:
        """Which host copies a CP node has: the target, and the draft when a draft pool exists."""
        return [False, True] if self.config.has_draft else [False]

    def _start_backup(self, node: Node) -> None:
        node.backup = "in_flight"
        self.ongoing_write[node.node_id] = node.handle

    def cancel_backup(self, handle: int) -> str:
        """Roll back a pending per-layer backup: cancel, then free the reserved host slots."""
        node = self.nodes[handle]
        per_layer = self._per_layer_controllers()
        for rank_index, controller in enumerate(self._cp_controllers()):
            per_layer[rank_index].cancel_layer_write_state(node.node_id)
            controller.evict_cp_host(self._meta(node, rank_index))
        node.backup = "none"
        node.cp_meta = [None] * len(self.world.ranks)
        node.reservations = []
        self.ongoing_write.pop(node.node_id, None)
        return f"cancelled backup of node {handle}"

    def has_pending_layer_write(self, handle: int) -> bool:
        node = self.nodes[handle]
        return any(node.node_id in c.pending_layer_writes for c in self._per_layer_controllers())

    # -- ack drains ----------------------------------------------------------------------------
    @staticmethod
    def _queue(controller: ControllerLike, queue_name: str) -> AckQueue:
        if queue_name == "ack_write_queue":
            return controller.ack_write_queue
        return controller.ack_load_queue

    def _ready_prefix(self, queue_name: str) -> int:
        """Leading acks whose finish event completed, MIN over ranks (FIFO prefix, INV-09)."""
        counts = []
        for controller in self._controllers():
            count = 0
            for ack in self._queue(controller, queue_name):
                if not ack.finish_event.query():
                    break
                count += 1
            counts.append(count)
        return min(counts)

    def _pop_rows(self, queue_name: str, count: int) -> list[list[int]]:
        rows_per_rank = []
        for controller in self._controllers():
            queue = self._queue(controller, queue_name)
            rows_per_rank.append([list(ack.node_ids) for ack in islice(queue, count)])
            del queue[:count]
        # Verify every rank acked the same nodes in the same order (INV-14)
        self._count("INV-14")
        try:
            check_ack_rows_identical(rows_per_rank)
        except InvariantViolation as violation:
            raise InvariantViolation("INV-14", f"{queue_name} drain: {violation.detail}") from None
        return rows_per_rank[0]

    def writing_check(self) -> str:
        rows = self._pop_rows("ack_write_queue", self._ready_prefix("ack_write_queue"))
        for row in rows:
            for node_id in row:
                handle = self.ongoing_write.pop(node_id, None)
                if handle is None:
                    raise InvariantViolation(
                        "INV-02",
                        f"write ack for node_id {node_id}, which has no backup in "
                        "flight (an extra ack, or an ack for a node already acked)",
                    )
                node = self.nodes[handle]
                node.backup = "done"
                self.acked_writes += 1
                self.check_host_bytes(node, "INV-09", "write ack drained")
        return f"drained {len(rows)} write ack(s)"

    def loading_check(self) -> str:
        rows = self._pop_rows("ack_load_queue", self._ready_prefix("ack_load_queue"))
        for row in rows:
            for node_id in row:
                handle = self.ongoing_load.pop(node_id, None)
                if handle is None:
                    raise InvariantViolation(
                        "INV-16", f"load ack for node_id {node_id}, which has no load in flight"
                    )
                node = self.nodes[handle]
                node.loading = False
                node.producer_id = None
                self.acked_loads += 1
                self.check_device_bytes(node, "INV-09", "load ack drained")
        return f"drained {len(rows)} load ack(s)"

    # -- load back -----------------------------------------------------------------------------
    def load_back(self, handle: int) -> str:
        node = self.nodes[handle]
        assert node.value is None and node.backup == "done" and not node.loading
        results: list[torch.Tensor | None] = []
        if self.config.uses_cp:
            for rank_index, cp in enumerate(self._cp_controllers()):
                view = _CpNodeView(node.node_id, node.logical_len, self._meta(node, rank_index))
                results.append(cp.load_cp([view], node_id=node.node_id))
        else:
            for rank_index, controller in enumerate(self._controllers()):
                host = node.host_value[rank_index]
                assert host is not None
                results.append(controller.load(host, node_id=node.node_id))
        if all(r is None for r in results):
            return "refused: device full"
        allocations = [r for r in results if r is not None]
        if len(allocations) < len(results) or any(
            not torch.equal(r, allocations[0]) for r in allocations
        ):
            raise InvariantViolation("INV-14", "CP ranks disagree on a load_cp allocation")
        node.value = allocations[0]
        if self.config.uses_cp:
            self._check_owner_replay(node)
        node.loading = True
        self.ongoing_load[node.node_id] = handle
        self.queued_loads.append(handle)
        return f"load node {handle} -> {allocations[0].numel()} locs"

    def _check_owner_replay(self, node: Node) -> None:
        """The fresh pages repeat the owners the harness recorded at write time (INV-03)."""
        assert node.value is not None
        page = self.config.page_size
        layout = self.world.ranks[0].cp_layout
        assert layout is not None
        padded = self._padded_locs(node.value)  # visible spans start page-aligned
        pages = torch.div(padded[::page], page, rounding_mode="floor")
        owners = layout.owner_for_logical_pages(pages).tolist()
        owner_of = {int(p): int(o) for p, o in zip(pages.tolist(), owners, strict=True)}
        self._count("INV-03")
        try:
            check_owner_replay(
                padded,
                node.page_owners,
                page,
                self.config.cp_size,
                owner_of_page=owner_of.__getitem__,
            )
        except InvariantViolation as violation:
            raise InvariantViolation("INV-03", f"node {node.handle}: {violation.detail}") from None

    def start_loading(self) -> str:
        ids = [controller.start_loading() for controller in self._controllers()]
        if len(set(ids)) != 1:
            raise InvariantViolation("INV-14", f"ranks took different producer slots {ids}")
        # Verify the slot is not still held by a load whose ack is undrained (INV-10)
        busy = sorted(
            n.handle
            for n in self.nodes.values()
            if n.loading and n.producer_id == ids[0] and n.handle not in self.queued_loads
        )
        if busy:
            raise InvariantViolation(
                "INV-10",
                f"start_loading handed out producer slot {ids[0]}, still held by the undrained "
                f"load of node(s) {busy} (a consumer of that slot would wait on the wrong events)",
            )
        for handle in self.queued_loads:
            if handle in self.nodes:
                self.nodes[handle].producer_id = ids[0]
        self.queued_loads.clear()
        return f"start_loading -> producer {ids[0]}"

    # -- eviction ------------------------------------------------------------------------------
    def evict_device(self, handle: int) -> str:
        node = self.nodes[handle]
        assert node.value is not None
        for controller in self._controllers():
            controller.evict_device(node.value)
        self._poison_freed_pages(node)
        node.value, node.placement_of = None, None
        return f"evict_device node {handle}"

    def drop(self, handle: int) -> str:
        """Free a node that was never backed up (its stores may still be queued: overlap)."""
        node = self.nodes.pop(handle)
        assert node.value is not None and node.backup == "none"
        if handle in self.batch:  # an aborted request leaves the forward batch
            self.batch.remove(handle)
            if not self.batch:
                self.batch_layer = 0
        for controller in self._controllers():
            controller.evict_device(node.value)
        self._poison_freed_pages(node)
        return f"drop node {handle}"

    def _poison_freed_pages(self, node: Node) -> None:
        """What reuse does to freed pages: another request's KV lands there. The forward stream
        fills them with poison, so a load whose read runs before its copy cannot pass by
        finding the bytes the same node left behind (a reload often gets its old pages back)."""
        assert node.value is not None
        for rank in range(len(self.world.ranks)):
            _, locs = self._placement(rank, node)
            buffers = [
                buf
                for draft, layer_num in self._layer_kinds()
                for layer in range(layer_num)
                for buf in self._pools(rank, draft)[0].layer_buffers(layer)
            ]

            def poison(buffers: list[torch.Tensor] = buffers, locs: torch.Tensor = locs) -> None:
                for buf in buffers:
                    buf[locs] = FREED_ROW_VALUE

            self.world.device.launch(poison, label=f"reuse n{node.handle}", kind="kernel")

    def evict_host(self, handle: int) -> str:
        node = self.nodes.pop(handle)
        if handle in self.batch:
            self.batch.remove(handle)
            if not self.batch:
                self.batch_layer = 0
        self._evict_host_copies(node, tuple(range(len(self.world.ranks))))
        return f"evict_host node {handle}"

    def _evict_host_copies(self, node: Node, ranks: tuple[int, ...]) -> None:
        for rank_index in ranks:
            if self.config.uses_cp:
                self._cp_controllers()[rank_index].evict_cp_host(self._meta(node, rank_index))
            else:
                host = node.host_value[rank_index]
                assert host is not None
                self.world.ranks[rank_index].controller.evict_host(host)

    # -- misuse probes --------------------------------------------------------------------------
    def write_in_flight(self, handle: int, rank: int | None = None) -> bool:
        """Whether the node's backup copy may still run on ``rank`` (any rank when None)."""
        node = self.nodes[handle]
        ranks = range(len(self.world.ranks)) if rank is None else (rank,)
        for r in ranks:
            controller = self.world.ranks[r].controller
            per_layer = self.world.ranks[r].per_layer
            if per_layer is not None and node.node_id in per_layer.pending_layer_writes:
                return True
            for ack in controller.ack_write_queue:
                if node.node_id in ack.node_ids and not ack.finish_event.query():
                    return True
        return False

    def load_in_flight(self, handle: int, rank: int | None = None) -> bool:
        node = self.nodes[handle]
        if not node.loading or node.producer_id is None:
            return False
        ranks = range(len(self.world.ranks)) if rank is None else (rank,)
        return any(
            node.node_id in ack.node_ids and not ack.finish_event.query()
            for r in ranks
            for ack in self.world.ranks[r].controller.ack_load_queue
        )

    def probe(self, kind: str, handle: int) -> str:
        """Ask the controller to do something unsafe; it must refuse and change nothing.

        The tree never does these on its own, so without probes a controller that lost its
        guard would pass every case (the mutants in fuzz/mutants/*ignores* / *during* show it).
        """
        node = self.nodes[handle]
        expected = {
            "evict_host": ("INV-07", "INV-15"),
            "evict_device": ("INV-08",),
            "rewrite": ("INV-02",),
        }[kind]
        for rank_index in range(len(self.world.ranks)):
            if not self._rank_uses_slots(kind, node, rank_index):
                continue  # this rank copies nothing for the node: there is nothing to protect
            busy = self.write_in_flight(handle, rank_index) or (
                kind == "evict_device" and self.load_in_flight(handle, rank_index)
            )
            if kind != "rewrite" and not busy:
                continue  # this rank's copy already landed: freeing would be legitimate here
            try:
                outcome = self._probe_call(kind, node, rank_index)
            except InvariantViolation as refusal:
                if refusal.inv_id not in expected:
                    raise
                continue
            if outcome == "refused":
                continue
            raise InvariantViolation(
                expected[0],
                f"rank {rank_index} accepted {kind} of node {handle} while its copy is still in "
                f"flight (it must refuse with {'/'.join(expected)} and change nothing)",
            )
        return f"probe {kind} node {handle}: refused"

    def _rank_uses_slots(self, kind: str, node: Node, rank_index: int) -> bool:
        if not self.config.uses_cp or kind == "rewrite":
            return True
        if kind == "evict_host":
            # the harness's own layout says whether this rank holds host slots of the node
            return node.cp_meta[rank_index] is not None and bool(
                len(node.owned_positions[rank_index])
            )
        assert node.value is not None
        return bool(len(self._placement(rank_index, node)[0]))

    def _probe_call(self, kind: str, node: Node, rank_index: int) -> str:
        controller = self.world.ranks[rank_index].controller
        assert kind == "evict_host" or node.value is not None
        if kind == "evict_host":
            self._evict_host_copies(node, (rank_index,))
        elif kind == "evict_device" and node.value is not None:
            controller.evict_device(node.value)
        elif self.config.uses_cp and node.value is not None:
            cp = self._cp_controllers()[rank_index]
            result = cp.reserve_write_cp(node.value, node_id=node.node_id)
            if is_write_failure(result) and result.reason == "undrained_ack":
                return "refused"
            reservation = as_reservation(result)
            if reservation is not None:
                cp.evict_cp_host(reservation.metadata)  # undo, then report the acceptance
        elif node.value is not None:
            controller.write(node.value, node_id=node.node_id)
        return "accepted"

    # -- reset ---------------------------------------------------------------------------------
    def reset(self) -> str:
        """Tree reset at idle: controller reset, pools cleared, node ids restart at 0."""
        self.world.device.run_until_idle()
        for rank in self.world.ranks:
            rank.controller.reset()
            rank.host_pool.clear()
            rank.allocator.clear()
            if rank.draft_host_pool is not None:
                rank.draft_host_pool.clear()
        self.nodes.clear()
        self.ongoing_write.clear()
        self.ongoing_load.clear()
        self.queued_loads.clear()
        self.batch, self.batch_layer = [], 0
        self.next_node_id = 0
        return "reset"

    # -- byte checks ---------------------------------------------------------------------------
    def check_host_bytes(self, node: Node, inv_id: str, when: str) -> None:
        for rank_index in range(len(self.world.ranks)):
            for draft, layer_num in self._layer_kinds():
                _, host_pool = self._pools(rank_index, draft)
                positions, slots = self._host_positions(rank_index, node, draft)
                for layer in range(layer_num):
                    for c, name in enumerate(host_pool.device_pool.component_names()):
                        actual = host_pool.read_rows(name, layer, slots)
                        rows = self._host_rows(
                            rank_index, node, (draft, layer, c), positions, tuple(actual.shape[1:])
                        )
                        self._check_rows(
                            actual,
                            rows,
                            inv_id,
                            f"{when}: host copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} {name} rank {rank_index}",
                        )

    def _host_rows(
        self,
        rank_index: int,
        node: Node,
        row_of: tuple[bool, int, int],
        positions: torch.Tensor,
        row_shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The oracle's rows at the node's host positions (cached while the harness's recorded
        layout, ``owned_positions``, is the same list; the positions depend on nothing else)."""
        if node.host_rows_of is not node.owned_positions:
            node.host_rows_of, node.host_rows_cache = node.owned_positions, {}
        draft, layer, component = row_of
        key = (rank_index, draft, layer, component, row_shape)
        rows = node.host_rows_cache.get(key)
        if rows is None:
            rows = expected_rows(node.handle, draft, layer, component, positions, row_shape)
            node.host_rows_cache[key] = rows
        return rows

    def _host_positions(
        self, rank_index: int, node: Node, draft: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions < logical_len held on this rank's host, their host slots).

        The positions come from the harness's layout (``Node.owned_positions``); only the slots
        are the implementation's, and their number must match (INV-13).
        """
        if not self.config.uses_cp:
            host = node.host_value[rank_index]  # draft copies reuse the target slots
            assert host is not None
            return torch.arange(node.logical_len), host
        owned = node.owned_positions[rank_index]
        keep = owned < node.logical_len
        return owned[keep], self._host_slots(rank_index, node, draft)[keep]

    def _host_slots(self, rank_index: int, node: Node, draft: bool) -> torch.Tensor:
        """The host (or draft host) slots the implementation chose for the node on a rank,
        after checking there is exactly one per position the harness's layout says it owns."""
        meta = self._meta(node, rank_index)
        slots = meta.draft_host_indices if draft else meta.host_indices
        owned = len(node.owned_positions[rank_index])
        self._count("INV-13")
        check_host_slot_count(
            0 if slots is None else len(slots),
            owned,
            f"node {node.handle} rank {rank_index}",
            pool="draft host" if draft else "host",
        )
        return slots if slots is not None else torch.empty((0,), dtype=torch.int64)

    def check_device_bytes(self, node: Node, inv_id: str, when: str) -> None:
        assert node.value is not None
        for rank_index in range(len(self.world.ranks)):
            _, locs = self._placement(rank_index, node)
            for draft, layer_num in self._layer_kinds():
                pool, _ = self._pools(rank_index, draft)
                for layer in range(min(layer_num, node.layers_stored)):
                    for c, buf in enumerate(pool.layer_buffers(layer)):
                        rows = self._device_rows(
                            rank_index, node, draft, layer, c, tuple(buf.shape[1:])
                        )
                        self._check_rows(
                            buf[locs],
                            rows,
                            inv_id,
                            f"{when}: device copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} component {c} "
                            f"rank {rank_index}",
                        )

    def _check_rows(
        self, actual: torch.Tensor, expected: torch.Tensor, inv_id: str, where: str
    ) -> None:
        """The rows hold the content oracle's bytes (INV-06; INV-09 at a drain, INV-11 read)."""
        self._count(inv_id)
        if (
            actual.device != expected.device
        ):  # a GPU world: the content oracle's rows are on the CPU
            actual = actual.to(expected.device)
        if torch.equal(actual, expected):
            return  # exact: the oracle's rows are never 0 or NaN, so equal values are equal bytes
        check_bytes_equal(
            actual,
            expected,
            where,
            inv_id=inv_id,
            describe_row=_describe,
            fix="bytes moved before their copy landed, or into the wrong slots",
        )

    # -- the harness's model, for the session's checks ------------------------------------------
    def model(self) -> HarnessModel:
        """What the tree recorded about its nodes' pages, as plain data (``invariants/``)."""
        nodes = tuple(self._holdings(node) for node in self.nodes.values())
        return HarnessModel(num_counters=self.config.num_counters, nodes=nodes)

    def _holdings(self, node: Node) -> NodeHoldings:
        """One node's pages, rebuilt only when a tensor it reads (or its backup) changed."""
        if self.config.uses_cp:
            metas = node.cp_meta or [None] * len(self.world.ranks)
            host_of = [meta.host_indices if meta else None for meta in metas]
            draft_of = [meta.draft_host_indices if meta else None for meta in metas]
        else:
            host_of = list(node.host_value)
            draft_of = []
        key = (node.value, node.backup, *host_of, *draft_of)
        cached = node.holdings_key
        if (
            node.holdings is not None
            and cached is not None
            and len(cached) == len(key)
            and all(a is b for a, b in zip(cached, key, strict=True))
        ):
            return node.holdings
        page = self.config.page_size
        device = _pages(node.value, page) if node.value is not None else frozenset()
        host = tuple(_pages(t, page) if t is not None else frozenset() for t in host_of)
        if self.config.uses_cp:
            draft = tuple(_pages(t, page) if t is not None else frozenset() for t in draft_of)
        else:
            draft = tuple(frozenset() for _ in self.world.ranks)
        node.holdings = NodeHoldings(node.handle, node.node_id, device, host, draft, node.backup)
        node.holdings_key = key
        return node.holdings


def handle_of(node: Node) -> int:
    return node.handle


def _describe(row: torch.Tensor) -> str:
    return describe_row(float(row.reshape(-1)[0]))


_PAGES_CACHE: dict[int, tuple[torch.Tensor, int, frozenset[int]]] = {}
_PAGES_CACHE_BOUND = 4096


def _pages(indices: torch.Tensor, page: int) -> frozenset[int]:
    """The pages an index tensor covers (cached per tensor: node tensors never change)."""
    hit = _PAGES_CACHE.get(id(indices))
    if hit is not None and hit[0] is indices and hit[1] == page:
        return hit[2]
    pages = frozenset(torch.unique(indices // page).tolist()) if indices.numel() else frozenset()
    if len(_PAGES_CACHE) >= _PAGES_CACHE_BOUND:
        _PAGES_CACHE.clear()
    _PAGES_CACHE[id(indices)] = (indices, page, pages)  # holds the tensor: its id stays unique
    return pages
