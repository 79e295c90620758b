"""The tree-side driver: what SGLang's radix cache does around the controller, written once.

It owns the radix nodes (here a flat table: the harness needs lifecycles, not prefix matching),
locks a node before its backup, drains only a FIFO prefix of completed acks (MIN over CP ranks),
unlocks per node id, pins a loading node until its ack, sets the consumer slot before a forward
read, and evicts host copies only when no op reads them. The state machines and the trace
replayer both drive the controller through this class, and every rule returns a short outcome
string so a trace says what happened.

Node lifecycle (specs/protocol.md): computing -> device -> backing_up -> backed_up ->
evicted (host only) -> loading -> backed_up; a node never backed up can be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.content import describe_row, expected_rows
from hicache_ref.harness.world import World


@dataclass
class Node:
    handle: int
    node_id: int
    logical_len: int
    value: torch.Tensor | None  # logical device locs [:logical_len], identical on every rank
    layers_stored: int = 0
    backup: str = "none"  # none | in_flight | done
    host_value: list[torch.Tensor | None] = field(default_factory=list)  # non-CP, per rank
    cp_meta: list[Any] = field(default_factory=list)  # CP metadata, per rank
    reservations: list[Any] = field(default_factory=list)  # early CP reservations, per rank
    loading: bool = False
    producer_id: int | None = None
    pending_reads: int = 0

    @property
    def on_device(self) -> bool:
        return self.value is not None


@dataclass
class _CpNodeView:
    """What ``load_cp`` reads from a node (id, host_len, cp_hicache) for one rank."""

    id: int
    host_len: int
    cp_hicache: Any


class TreeDriver:
    """Drives every rank's controller in lockstep, as the radix cache and scheduler would."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.config = world.config
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

    def handles(self, predicate: Any) -> list[int]:
        return sorted(h for h, n in self.nodes.items() if predicate(n))

    def _controllers(self) -> list[Any]:
        return [rank.controller for rank in self.world.ranks]

    def _owned_positions(self, rank: int, node: Node, locs: torch.Tensor) -> torch.Tensor:
        """Positions (< logical_len) of ``locs`` whose page this rank owns (all when no CP)."""
        positions = torch.arange(node.logical_len)
        if not self.config.uses_cp:
            return positions
        layout = self.world.ranks[rank].cp_layout
        assert layout is not None
        mask = layout.owned_by_this_rank(locs[: node.logical_len])
        return positions[mask]

    def _physical(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        layout = self.world.ranks[rank].cp_layout
        if layout is None:
            return locs
        physical: torch.Tensor = layout.logical_locs_to_physical(locs)
        return physical

    def _pools(self, rank: int, draft: bool) -> tuple[Any, Any]:
        r = self.world.ranks[rank]
        return (r.draft_device_pool, r.draft_host_pool) if draft else (r.device_pool, r.host_pool)

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
            if not torch.equal(other, first):
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
        if early_reserve and self.config.uses_cp:
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
        for controller, reservation in zip(self._controllers(), node.reservations, strict=True):
            controller.submit_write_cp_layer(
                reservation, layer, submit_target=not draft, submit_draft=draft
            )
        return f"submit {'draft' if draft else 'target'} layer {layer} of node {handle}"

    def _enqueue_store(self, rank: int, node: Node, draft: bool, layer: int) -> None:
        assert node.value is not None
        pool, _ = self._pools(rank, draft)
        positions = self._owned_positions(rank, node, node.value)
        locs = self._physical(rank, node.value[positions])
        buffers = pool.layer_buffers(layer)
        uid = node.handle
        payload = [
            expected_rows(uid, draft, layer, c, positions, tuple(buf.shape[1:]))
            for c, buf in enumerate(buffers)
        ]

        def store() -> None:
            for buf, rows in zip(buffers, payload, strict=True):
                buf[locs] = rows

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
            positions = self._owned_positions(rank_index, node, node.value)
            locs = self._physical(rank_index, node.value[positions])
            buffers = pool.layer_buffers(layer)
            expected = [
                expected_rows(node.handle, draft, layer, c, positions, tuple(buf.shape[1:]))
                for c, buf in enumerate(buffers)
            ]
            node.pending_reads += 1

            def read(
                buffers: Any = buffers,
                expected: Any = expected,
                locs: Any = locs,
                rank_index: int = rank_index,
            ) -> None:
                node.pending_reads -= 1
                for c, (buf, rows) in enumerate(zip(buffers, expected, strict=True)):
                    _check_rows(
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
        node.host_value[0] = host
        self._start_backup(node)
        return f"write node {handle} -> host {host.numel()} slots"

    def _reserve_cp(self, node: Node, *, catch_up: bool) -> str:
        """Reserve on every rank, agree, then submit: a rank-local failure must not ack alone."""
        from hicache_ref.invariants.models import HiCacheWriteFailure

        assert node.value is not None
        results = [
            c.reserve_write_cp(node.value, node_id=node.node_id) for c in self._controllers()
        ]
        if any(isinstance(r, HiCacheWriteFailure) for r in results):
            for controller, result in zip(self._controllers(), results, strict=True):
                if not isinstance(result, HiCacheWriteFailure):
                    controller.evict_cp_host(result.metadata)
            reasons = sorted({r.reason for r in results if isinstance(r, HiCacheWriteFailure)})
            return f"refused: {', '.join(reasons)}"
        for controller, result in zip(self._controllers(), results, strict=True):
            controller.submit_write_cp_per_layer(result, catch_up_all_layers=catch_up)
        node.cp_meta = [r.metadata for r in results]
        node.reservations = list(results)
        self._start_backup(node)
        return f"reserve node {handle_of(node)} on {len(results)} rank(s)"

    def _start_backup(self, node: Node) -> None:
        node.backup = "in_flight"
        self.ongoing_write[node.node_id] = node.handle

    def cancel_backup(self, handle: int) -> str:
        """Roll back a pending per-layer backup: cancel, then free the reserved host slots."""
        node = self.nodes[handle]
        for controller, meta in zip(self._controllers(), node.cp_meta, strict=True):
            controller.cancel_layer_write_state(node.node_id)
            controller.evict_cp_host(meta)
        node.backup = "none"
        node.cp_meta = [None] * len(self.world.ranks)
        node.reservations = []
        self.ongoing_write.pop(node.node_id, None)
        return f"cancelled backup of node {handle}"

    def has_pending_layer_write(self, handle: int) -> bool:
        node = self.nodes[handle]
        return any(
            node.node_id in getattr(c, "pending_layer_writes", {}) for c in self._controllers()
        )

    # -- ack drains ----------------------------------------------------------------------------
    def _ready_prefix(self, queue_name: str) -> int:
        """Leading acks whose finish event completed, MIN over ranks (FIFO prefix, INV-09)."""
        counts = []
        for controller in self._controllers():
            count = 0
            for ack in getattr(controller, queue_name):
                if not ack.finish_event.query():
                    break
                count += 1
            counts.append(count)
        return min(counts)

    def _pop_rows(self, queue_name: str, count: int) -> list[list[int]]:
        rows_per_rank = []
        for controller in self._controllers():
            queue = getattr(controller, queue_name)
            rows_per_rank.append([list(ack.node_ids) for ack in queue[:count]])
            del queue[:count]
        # Verify every rank acked the same nodes in the same order (INV-14)
        for rank, rows in enumerate(rows_per_rank[1:], start=1):
            if rows != rows_per_rank[0]:
                raise InvariantViolation(
                    "INV-14",
                    f"{queue_name} rows differ: rank 0 {rows_per_rank[0]} vs rank {rank} {rows}",
                )
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
        results = []
        for rank_index, controller in enumerate(self._controllers()):
            if self.config.uses_cp:
                view = _CpNodeView(node.node_id, node.logical_len, node.cp_meta[rank_index])
                results.append(controller.load_cp([view], node_id=node.node_id))
            else:
                host = node.host_value[rank_index]
                results.append(controller.load(host, node_id=node.node_id))
        if all(r is None for r in results):
            return "refused: device full"
        if any(r is None for r in results) or any(not torch.equal(r, results[0]) for r in results):
            raise InvariantViolation("INV-14", "CP ranks disagree on a load_cp allocation")
        node.value = results[0]
        if self.config.uses_cp:
            self._check_owner_replay(node)
        node.loading = True
        self.ongoing_load[node.node_id] = handle
        self.queued_loads.append(handle)
        return f"load node {handle} -> {results[0].numel()} locs"

    def _check_owner_replay(self, node: Node) -> None:
        """The fresh pages repeat the owner pattern recorded at write time (INV-03)."""
        assert node.value is not None
        page = self.config.page_size
        first_locs = node.value[::page]  # one loc per page: visible spans start page-aligned
        layout = self.world.ranks[0].cp_layout
        assert layout is not None
        got = layout.owner_for_logical_pages(first_locs // page).tolist()
        want = node.cp_meta[0].page_owners.tolist()
        if [int(x) for x in got] != [int(x) for x in want]:
            raise InvariantViolation(
                "INV-03",
                f"load_cp of node {node.handle} got pages owned by ranks {got}, but the write "
                f"recorded owners {want} (each rank would load into pages it does not own)",
            )

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
        node.value = None
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
        return f"drop node {handle}"

    def evict_host(self, handle: int) -> str:
        node = self.nodes.pop(handle)
        if handle in self.batch:
            self.batch.remove(handle)
            if not self.batch:
                self.batch_layer = 0
        for rank_index, controller in enumerate(self._controllers()):
            if self.config.uses_cp:
                controller.evict_cp_host(node.cp_meta[rank_index])
            else:
                controller.evict_host(node.host_value[rank_index])
        return f"evict_host node {handle}"

    # -- misuse probes --------------------------------------------------------------------------
    def write_in_flight(self, handle: int, rank: int | None = None) -> bool:
        """Whether the node's backup copy may still run on ``rank`` (any rank when None)."""
        node = self.nodes[handle]
        ranks = range(len(self.world.ranks)) if rank is None else (rank,)
        for r in ranks:
            controller = self.world.ranks[r].controller
            if node.node_id in getattr(controller, "pending_layer_writes", {}):
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
        for rank_index, controller in enumerate(self._controllers()):
            if not self._rank_uses_slots(kind, node, rank_index):
                continue  # this rank copies nothing for the node: there is nothing to protect
            busy = self.write_in_flight(handle, rank_index) or (
                kind == "evict_device" and self.load_in_flight(handle, rank_index)
            )
            if kind != "rewrite" and not busy:
                continue  # this rank's copy already landed: freeing would be legitimate here
            try:
                outcome = self._probe_call(kind, node, rank_index, controller)
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
            meta = node.cp_meta[rank_index]
            return meta is not None and len(meta.host_indices) > 0
        assert node.value is not None
        return bool(len(self._owned_positions(rank_index, node, node.value)))

    def _probe_call(self, kind: str, node: Node, rank_index: int, controller: Any) -> str:
        from hicache_ref.invariants.models import HiCacheWriteFailure

        if kind == "evict_host":
            if self.config.uses_cp:
                controller.evict_cp_host(node.cp_meta[rank_index])
            else:
                controller.evict_host(node.host_value[rank_index])
        elif kind == "evict_device":
            controller.evict_device(node.value)
        elif self.config.uses_cp:
            result = controller.reserve_write_cp(node.value, node_id=node.node_id)
            if isinstance(result, HiCacheWriteFailure) and result.reason == "undrained_ack":
                return "refused"
            if not isinstance(result, HiCacheWriteFailure):
                controller.evict_cp_host(result.metadata)  # undo, then report the acceptance
        else:
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
                        rows = expected_rows(
                            node.handle, draft, layer, c, positions, tuple(actual.shape[1:])
                        )
                        _check_rows(
                            actual,
                            rows,
                            inv_id,
                            f"{when}: host copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} {name} rank {rank_index}",
                        )

    def _host_positions(
        self, rank_index: int, node: Node, draft: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions < logical_len held on this rank's host, their host slots)."""
        if not self.config.uses_cp:
            host = node.host_value[rank_index]  # draft copies reuse the target slots
            assert host is not None
            return torch.arange(node.logical_len), host
        meta = node.cp_meta[rank_index]
        owned = meta.owned_positions
        keep = owned < node.logical_len
        slots = meta.draft_host_indices if draft else meta.host_indices
        return owned[keep], slots[keep]

    def check_device_bytes(self, node: Node, inv_id: str, when: str) -> None:
        assert node.value is not None
        for rank_index in range(len(self.world.ranks)):
            positions = self._owned_positions(rank_index, node, node.value)
            locs = self._physical(rank_index, node.value[positions])
            for draft, layer_num in self._layer_kinds():
                pool, _ = self._pools(rank_index, draft)
                for layer in range(min(layer_num, node.layers_stored)):
                    for c, buf in enumerate(pool.layer_buffers(layer)):
                        rows = expected_rows(
                            node.handle, draft, layer, c, positions, tuple(buf.shape[1:])
                        )
                        _check_rows(
                            buf[locs],
                            rows,
                            inv_id,
                            f"{when}: device copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} component {c} "
                            f"rank {rank_index}",
                        )


def handle_of(node: Node) -> int:
    return node.handle


def _check_rows(actual: torch.Tensor, expected: torch.Tensor, inv_id: str, where: str) -> None:
    if torch.equal(actual, expected):
        return
    differs = (actual != expected).reshape(len(actual), -1).any(dim=1).nonzero()
    row = int(differs[0])
    raise InvariantViolation(
        inv_id,
        f"{where}: row {row} holds {describe_row(float(actual[row].reshape(-1)[0]))}, expected "
        f"{describe_row(float(expected[row].reshape(-1)[0]))} (bytes moved before their copy "
        "landed, or into the wrong slots)",
    )
