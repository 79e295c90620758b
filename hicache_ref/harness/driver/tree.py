"""The tree-side driver: what SGLang's radix cache does around the controller, as verbs.

It owns the radix nodes (``node_model.py``; a flat table: the harness needs lifecycles, not
prefix matching), locks a node before its backup, drains only a FIFO prefix of completed acks
(MIN over CP ranks), unlocks per node id, pins a loading node until its ack, sets the consumer
slot(s) before a forward read, and evicts host copies only when no op reads them. The state
machines and the trace replayer both drive the controller through this class, and every verb
returns a short outcome string so a trace says what happened.

The verbs, in the order data flows: prefill -> forward_layer / store_layer / layer_end ->
write_backup / reserve / submit_layer -> writing_check -> evict_device / drop -> load_back ->
start_loading -> forward_read / forward_read_batch -> loading_check -> evict_host ->
cancel_backup -> reset / reset_in_flight; and ``scribble_free_host``, the CPU writing into free
host slots while copies run. Where bytes live per rank is ``rank_geometry.py``, every byte
comparison and the free-slot poison ``byte_checks.py``, the misuse probes ``probes.py``.

The driver calls implementations only through the contract of ``adapters/base.py`` and trusts
none of their bookkeeping: where a node's bytes live on each rank (owned positions, padding,
page owners) is computed from the harness's own CP layout; from the implementation it takes only
the host slots it chose, and checks their number (INV-13). Without ``per_layer_write`` CP
backups go through ``submit_write_cp_all_layer`` and nothing is reserved early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from itertools import islice
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from hicache_ref.harness.adapters.base import (
    AckQueue,
    ControllerLike,
    CpControllerLike,
    PerLayerWriteLike,
    as_reservation,
    is_write_failure,
)
from hicache_ref.harness.driver.byte_checks import ByteChecks, DeferredReads, FreeSlotWatch
from hicache_ref.harness.driver.node_model import (
    FORWARD_META,
    CpNodeView,
    ForwardKernel,
    Node,
    compute_holdings,
    handle_of,
)
from hicache_ref.harness.driver.probes import MisuseProbes, ProbeKind
from hicache_ref.harness.driver.rank_geometry import RankGeometry
from hicache_ref.harness.driver.store_watch import StoreWatch
from hicache_ref.harness.steps.outcome import Outcome, done, refused
from hicache_ref.harness.world.content import FREED_ROW_VALUE
from hicache_ref.harness.world.world import World
from hicache_ref.invariants.evidence import DrainedAck, RankValues, ReturnedIndices, SlotReuse
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.snapshot import HarnessModel

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver

__all__ = ["Node", "TreeDriver", "handle_of"]


@runtime_checkable
class MultiConsumerCounterLike(Protocol):
    """``layer_done_counter`` with capability ``multi_consumer``: one forward batch waits on
    the layer events of several producer slots (the reference's and the seed's counters)."""

    def set_consumer(self, index: int | Sequence[int], /) -> None: ...


class TreeDriver:
    """Drives every rank's controller in lockstep, as the radix cache and scheduler would."""

    def __init__(self, world: World, checks: CheckRunner | None = None) -> None:
        self.world = world
        self.config = world.config
        self.checks = CheckRunner() if checks is None else checks  # the registry, per id
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
        self.geometry = RankGeometry(world, self.checks)
        self.bytes = ByteChecks(world, self.geometry, self.checks)
        self.watch = FreeSlotWatch(world, self.geometry, self.bytes)
        self.reads = DeferredReads(world, self.bytes)
        self.stores = StoreWatch(world, self.checks, self._rows_backing_up)
        self.probes = MisuseProbes(self)
        self.storage: StorageDriver | None = None  # a storage world's L3 side (Session sets it)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        return max(self.config.layer_num, self.config.draft_layer_num)

    def node(self, handle: int) -> Node | None:
        return self.nodes.get(handle)

    def handles(self, predicate: Callable[[Node], bool]) -> list[int]:
        return sorted(h for h, n in self.nodes.items() if predicate(n))

    def layer_kinds(self) -> list[tuple[bool, int]]:
        """(draft, layer_num) of the target and, when there is one, the draft pool."""
        return self.geometry.layer_kinds()

    def _controllers(self) -> list[ControllerLike]:
        return [rank.controller for rank in self.world.ranks]

    def cp_controllers(self) -> list[CpControllerLike]:
        """Every rank's controller as the CP contract (only on a CP world)."""
        out = [rank.cp for rank in self.world.ranks]
        assert all(c is not None for c in out), "CP verbs on a world without CP"
        return [c for c in out if c is not None]

    def _per_layer_controllers(self) -> list[PerLayerWriteLike]:
        """Every rank's controller as the per-layer contract (empty without per_layer_write)."""
        return [rank.per_layer for rank in self.world.ranks if rank.per_layer is not None]

    def _on_forward(self) -> AbstractContextManager[object]:
        """The forward's stream: its own under overlap scheduling (``config.forward_stream``)."""
        return self.world.device.stream(self.world.forward_stream)

    # -- what the probes and the byte checks answer (their modules hold the code) --------------
    def write_in_flight(self, handle: int, rank: int | None = None) -> bool:
        return self.probes.write_in_flight(handle, rank)

    def load_in_flight(self, handle: int, rank: int | None = None) -> bool:
        return self.probes.load_in_flight(handle, rank)

    def probe(self, kind: ProbeKind, handle: int) -> Outcome:
        """A misuse probe (``probes.py``): the controller must refuse and change nothing."""
        return self.probes.probe(kind, handle)

    def check_host_bytes(self, node: Node, inv_id: str, when: str) -> None:
        self.bytes.check_host_bytes(node, inv_id, when)

    def check_device_bytes(self, node: Node, inv_id: str, when: str) -> None:
        self.bytes.check_device_bytes(node, inv_id, when)

    # -- prefill and the forward pass ----------------------------------------------------------
    def prefill(
        self, num_tokens: int, early_reserve: bool, handle: int | None = None, batch: bool = True
    ) -> Outcome:
        """Allocate a new node's pages; its KV is stored layer by layer by ``forward_layer``."""
        handle = self.next_handle if handle is None else handle
        self.next_handle = max(self.next_handle, handle) + 1  # consumed even when refused
        page = self.config.page_size
        logical_len = num_tokens if self.config.uses_cp else -(-num_tokens // page) * page
        padded_len = -(-logical_len // page) * page
        if self.batch_layer > 0:
            return refused("a forward batch is mid-way (it finishes first)")
        allocs = [rank.allocator.alloc(padded_len) for rank in self.world.ranks]
        if any(a is None for a in allocs):
            for a, rank in zip(allocs, self.world.ranks, strict=True):
                if a is not None:
                    rank.allocator.free(a)
            return refused("device full")
        first = allocs[0]
        assert first is not None
        if len(allocs) > 1:
            pages = [[a.tolist() if a is not None else []] for a in allocs]
            values = RankValues("the allocators' logical pages", pages, ack_rows=False)
            self.checks.run("INV-14", values)
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
        text = f"node {handle} ({logical_len} tokens)"
        if early_reserve and self.config.uses_cp and self.world.per_layer_write:
            early = self._reserve_cp(node, catch_up=False)
            return Outcome(
                f"{text}; {early.text}",
                reservation="refused" if early.refused else "made",
                agreed=f"{text}; {early.shared}",
            )
        return done(text)

    def forward_layer(self) -> Outcome:
        """One layer of the forward batch: queue every batch node's KV store, then the hooks.

        All nodes prefilled together form one batch (a forward pass computes them together),
        so a layer-end hook fires only after that layer was stored for every pending node.
        """
        batch = [self.nodes[h] for h in self.batch]
        layer = self.batch_layer
        assert batch and layer < self.total_layers
        for draft, layer_num in self.geometry.layer_kinds():
            if layer >= layer_num:
                continue
            with self._on_forward():
                for node in batch:
                    if node.value is None:
                        continue
                    for rank in range(len(self.world.ranks)):
                        self._enqueue_store(rank, node, draft, layer)
                for rank in range(len(self.world.ranks)):
                    pool, _ = self.geometry.pools(rank, draft)
                    pool.notify_layer_end(layer)
        for node in batch:
            node.layers_stored = layer + 1
        self.batch_layer += 1
        if self.batch_layer == self.total_layers:
            self.batch, self.batch_layer = [], 0
        return done(f"stored layer {layer} of nodes {[n.handle for n in batch]}")

    def store_layer(self, handle: int, layer: int, draft: bool) -> Outcome:
        """Queue one layer's KV store of one node (fine-grained; oracle traces use it)."""
        node = self.nodes[handle]
        with self._on_forward():
            for rank in range(len(self.world.ranks)):
                self._enqueue_store(rank, node, draft, layer)
        if not draft or self.config.draft_layer_num >= self.config.layer_num:
            node.layers_stored = max(node.layers_stored, layer + 1)
        return done(f"stored {'draft' if draft else 'target'} layer {layer} of node {handle}")

    def layer_end(self, layer: int, draft: bool) -> Outcome:
        """The device pools' layer-end hooks for ``layer`` (drives pending per-layer writes)."""
        with self._on_forward():
            for rank in range(len(self.world.ranks)):
                pool, _ = self.geometry.pools(rank, draft)
                pool.notify_layer_end(layer)
        return done(f"layer_end {layer} ({'draft' if draft else 'target'})")

    def reserve(self, handle: int) -> Outcome:
        """Early CP reservation of an existing node (catch_up_all_layers=False)."""
        return self._reserve_cp(self.nodes[handle], catch_up=False)

    def submit_layer(self, handle: int, layer: int, draft: bool) -> Outcome:
        node = self.nodes[handle]
        controllers = self._per_layer_controllers()
        for controller, reservation in zip(controllers, node.reservations, strict=True):
            controller.submit_write_cp_layer(
                reservation, layer, submit_target=not draft, submit_draft=draft
            )
        return done(f"submit {'draft' if draft else 'target'} layer {layer} of node {handle}")

    def _enqueue_store(self, rank: int, node: Node, draft: bool, layer: int) -> None:
        assert node.value is not None
        pool, _ = self.geometry.pools(rank, draft)
        _, locs = self.geometry.placement(rank, node)
        buffers = pool.layer_buffers(layer)
        payload = [
            self.bytes.staged_rows(rank, node, (draft, layer, c), buf)
            for c, buf in enumerate(buffers)
        ]  # on the buffers' device before the launch: the store itself never syncs the host

        stores, pool_name = self.stores, "draft" if draft else "target"
        rows_at = locs.tolist() if stores.active else []  # never a host sync on a GPU

        def store() -> None:
            for buf, rows in zip(buffers, payload, strict=True):
                buf[locs] = rows
            stores.stored(rank, pool_name, layer, rows_at)

        kernel = ForwardKernel("store", node.handle, layer)
        self.world.device.launch(
            store,
            label=f"store n{node.handle} L{layer}",
            kind="kernel",
            meta={FORWARD_META: kernel},
        )

    def forward_read(self, handle: int, layer: int, draft: bool) -> Outcome:
        """The forward reads one layer of the node: wait on the consumer slot, then check bytes."""
        node = self.nodes[handle]
        assert node.value is not None
        consumer = node.producer_id if node.loading and node.producer_id is not None else -1
        for rank_index, rank in enumerate(self.world.ranks):
            rank.controller.layer_done_counter.set_consumer(consumer)
            pool, _ = self.geometry.pools(rank_index, draft)
            with self._on_forward():
                pool.get_key_buffer(layer)  # waits until this layer landed (INV-11)
                self._launch_read(rank_index, node, layer, draft)
        for rank in self.world.ranks:
            rank.controller.layer_done_counter.set_consumer(-1)
        return done(f"read layer {layer} of node {handle}")

    def forward_read_batch(self, handles: Sequence[int], layer: int, draft: bool) -> Outcome:
        """One forward batch reads one layer of several nodes, loaded by different
        ``start_loading`` calls: the consumer is every producer slot of the batch at once
        (capability ``multi_consumer``), and the one wait must cover each slot's layer event."""
        nodes = [self.nodes[h] for h in handles]
        consumers = sorted(
            {n.producer_id for n in nodes if n.loading and n.producer_id is not None}
        )
        for rank_index, rank in enumerate(self.world.ranks):
            counter = rank.controller.layer_done_counter
            assert isinstance(counter, MultiConsumerCounterLike), "multi_consumer was declared"
            counter.set_consumer(consumers)
            pool, _ = self.geometry.pools(rank_index, draft)
            with self._on_forward():
                pool.get_key_buffer(layer)  # waits until this layer landed in every slot (INV-11)
                for node in nodes:
                    self._launch_read(rank_index, node, layer, draft)
        for rank in self.world.ranks:
            rank.controller.layer_done_counter.set_consumer(-1)
        return done(f"read layer {layer} of nodes {list(handles)} (consumers {consumers})")

    def _launch_read(self, rank_index: int, node: Node, layer: int, draft: bool) -> None:
        """Queue a read of one layer of the node on the forward stream; it checks the bytes
        (on a GPU once the read has run: ``DeferredReads``)."""
        pool, _ = self.geometry.pools(rank_index, draft)
        _, locs = self.geometry.placement(rank_index, node)
        buffers = pool.layer_buffers(layer)
        expected = [
            self.bytes.device_rows(rank_index, node, draft, layer, c, tuple(buf.shape[1:]))
            for c, buf in enumerate(buffers)
        ]
        node.pending_reads += 1
        handle = node.handle

        def read() -> None:
            node.pending_reads -= 1
            for c, (buf, rows) in enumerate(zip(buffers, expected, strict=True)):
                where = (
                    f"forward read of node {handle} {'draft' if draft else 'target'} "
                    f"layer {layer} component {c} on rank {rank_index}"
                )
                if buf.is_cuda:
                    self.reads.defer(buf[locs], rows, where)
                else:
                    self.bytes.check_rows(buf[locs], rows, "INV-11", where)

        kernel = ForwardKernel("read", handle, layer)
        self.world.device.launch(
            read, label=f"read n{handle} L{layer}", kind="kernel", meta={FORWARD_META: kernel}
        )

    # -- write back ----------------------------------------------------------------------------
    def write_backup(self, handle: int) -> Outcome:
        node = self.nodes[handle]
        assert node.value is not None and node.backup == "none"
        if self.config.uses_cp:
            return self._reserve_cp(node, catch_up=True)
        host = self.world.ranks[0].controller.write(node.value, node_id=node.node_id)
        if host is None:
            return refused("host full")
        assert isinstance(host, torch.Tensor), "a non-CP write returns host indices or None"
        page = self.config.page_size
        self.checks.run("INV-01", ReturnedIndices(host, page, f"write of node {handle}"))
        node.host_value[0] = host
        self._start_backup(node)
        return done(f"write node {handle} -> host {host.numel()} slots")

    def _reserve_cp(self, node: Node, *, catch_up: bool) -> Outcome:
        """Reserve on every rank, agree, then submit: a rank-local failure must not ack alone."""
        assert node.value is not None
        assert catch_up or self.world.per_layer_write, "early reservations need per_layer_write"
        controllers = self.cp_controllers()
        results = [c.reserve_write_cp(node.value, node_id=node.node_id) for c in controllers]
        reservations = [as_reservation(r) for r in results]
        if any(r is None for r in reservations):
            for controller, reservation in zip(controllers, reservations, strict=True):
                if reservation is not None:
                    controller.evict_cp_host(reservation.metadata)
            reasons = sorted({r.reason for r in results if is_write_failure(r)})
            # which rank's (or which pool's) capacity fell short is rank-local
            shared = sorted({"capacity" if "capacity" in r else r for r in reasons})
            return refused(", ".join(reasons), agreed=f"refused: {', '.join(shared)}")
        held = [r for r in reservations if r is not None]
        node.cp_meta = [r.metadata for r in held]
        self.geometry.record_layout(node)
        for rank_index in range(len(controllers)):
            self.geometry.check_reservation(rank_index, node)  # INV-01, INV-13
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
        return done(f"reserve node {handle_of(node)} on {len(results)} rank(s)")

    def _start_backup(self, node: Node) -> None:
        node.backup = "in_flight"
        self.ongoing_write[node.node_id] = node.handle

    def cancel_backup(self, handle: int) -> Outcome:
        """Roll back a pending per-layer backup: cancel, then free the reserved host slots."""
        node = self.nodes[handle]
        per_layer = self._per_layer_controllers()
        for rank_index, controller in enumerate(self.cp_controllers()):
            per_layer[rank_index].cancel_layer_write_state(node.node_id)
            controller.evict_cp_host(self.geometry.meta(node, rank_index))
        node.backup = "none"
        node.cp_meta = [None] * len(self.world.ranks)
        node.reservations = []
        self.ongoing_write.pop(node.node_id, None)
        return done(f"cancelled backup of node {handle}")

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
        self.checks.run("INV-14", RankValues(f"{queue_name} drain", rows_per_rank))
        return rows_per_rank[0]

    def writing_check(self) -> Outcome:
        rows = self._pop_rows("ack_write_queue", self._ready_prefix("ack_write_queue"))
        for row in rows:
            for node_id in row:
                handle = self.ongoing_write.pop(node_id, None)
                drained = DrainedAck("ack_write_queue", node_id, in_flight=handle is not None)
                self.checks.run("INV-02", drained)
                assert handle is not None
                node = self.nodes[handle]
                node.backup = "done"
                self.acked_writes += 1
                self.check_host_bytes(node, "INV-09", "write ack drained")
        return done(f"drained {len(rows)} write ack(s)")

    def loading_check(self) -> Outcome:
        rows = self._pop_rows("ack_load_queue", self._ready_prefix("ack_load_queue"))
        for row in rows:
            for node_id in row:
                handle = self.ongoing_load.pop(node_id, None)
                drained = DrainedAck("ack_load_queue", node_id, in_flight=handle is not None)
                self.checks.run("INV-16", drained)
                assert handle is not None
                node = self.nodes[handle]
                node.loading = False
                node.producer_id = None
                self.acked_loads += 1
                self.check_device_bytes(node, "INV-09", "load ack drained")
        return done(f"drained {len(rows)} load ack(s)")

    # -- load back -----------------------------------------------------------------------------
    def load_back(self, handle: int) -> Outcome:
        node = self.nodes[handle]
        assert node.value is None and node.backup == "done" and not node.loading
        results: list[torch.Tensor | None] = []
        if self.config.uses_cp:
            for rank_index, cp in enumerate(self.cp_controllers()):
                view = CpNodeView(
                    node.node_id, node.logical_len, self.geometry.meta(node, rank_index)
                )
                results.append(cp.load_cp([view], node_id=node.node_id))
        else:
            for rank_index, controller in enumerate(self._controllers()):
                host = node.host_value[rank_index]
                assert host is not None
                results.append(controller.load(host, node_id=node.node_id))
        if all(r is None for r in results):
            return refused("device full")
        allocations = [r for r in results if r is not None]
        if len(results) > 1:
            rows = [[r.tolist() if r is not None else []] for r in results]
            self.checks.run("INV-14", RankValues("the load_cp allocations", rows, ack_rows=False))
        node.value = allocations[0]
        if self.config.uses_cp:
            self.geometry.check_owner_replay(node)
        node.loading = True
        self.ongoing_load[node.node_id] = handle
        self.queued_loads.append(handle)
        return done(f"load node {handle} -> {allocations[0].numel()} locs")

    def start_loading(self) -> Outcome:
        ids = [controller.start_loading() for controller in self._controllers()]
        if len(ids) > 1:
            slots = RankValues("the producer slots", [[[i]] for i in ids], ack_rows=False)
            self.checks.run("INV-14", slots)
        busy = sorted(
            n.handle
            for n in self.nodes.values()
            if n.loading and n.producer_id == ids[0] and n.handle not in self.queued_loads
        )
        self.checks.run("INV-10", SlotReuse(ids[0], busy))
        for handle in self.queued_loads:
            if handle in self.nodes:
                self.nodes[handle].producer_id = ids[0]
        self.queued_loads.clear()
        return done(f"start_loading -> producer {ids[0]}")

    # -- eviction ------------------------------------------------------------------------------
    def evict_device(self, handle: int) -> Outcome:
        node = self.nodes[handle]
        assert node.value is not None
        for controller in self._controllers():
            controller.evict_device(node.value)
        self._poison_freed_pages(node)
        node.value, node.placement_of = None, None
        return done(f"evict_device node {handle}")

    def drop(self, handle: int) -> Outcome:
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
        return done(f"drop node {handle}")

    def _poison_freed_pages(self, node: Node) -> None:
        """What reuse does to freed pages: another request's KV lands there. The forward stream
        fills them with poison, so a load whose read runs before its copy cannot pass by
        finding the bytes the same node left behind (a reload often gets its old pages back)."""
        assert node.value is not None
        for rank in range(len(self.world.ranks)):
            _, locs = self.geometry.placement(rank, node)
            buffers = [
                buf
                for draft, layer_num in self.geometry.layer_kinds()
                for layer in range(layer_num)
                for buf in self.geometry.pools(rank, draft)[0].layer_buffers(layer)
            ]

            pools = [("draft" if d else "target", n) for d, n in self.geometry.layer_kinds()]

            def poison(
                buffers: list[torch.Tensor] = buffers,
                locs: torch.Tensor = locs,
                rank: int = rank,
                pools: list[tuple[str, int]] = pools,
            ) -> None:
                for buf in buffers:
                    # index_fill_, not ``buf[locs] = value``: a Python scalar assigned through an
                    # index is uploaded first, and that pageable upload makes the host wait for
                    # the forward stream (measured on an H200: 101 ms behind a 100 ms spin;
                    # benchmarks/host_waits.py), draining the stores a load must race
                    buf.index_fill_(0, locs, FREED_ROW_VALUE)
                if self.stores.active:  # the simulator only: never a host sync on a GPU
                    self.stores.poisoned(rank, pools, locs.tolist())

            with self._on_forward():
                self.world.device.launch(poison, label=f"reuse n{node.handle}", kind="kernel")

    def evict_host(self, handle: int) -> Outcome:
        node = self.nodes.pop(handle)
        if handle in self.batch:
            self.batch.remove(handle)
            if not self.batch:
                self.batch_layer = 0
        self.evict_host_copies(node, tuple(range(len(self.world.ranks))))
        return done(f"evict_host node {handle}")

    def evict_host_copies(self, node: Node, ranks: tuple[int, ...]) -> None:
        for rank_index in ranks:
            if self.config.uses_cp:
                self.cp_controllers()[rank_index].evict_cp_host(
                    self.geometry.meta(node, rank_index)
                )
            else:
                host = node.host_value[rank_index]
                assert host is not None
                self.world.ranks[rank_index].controller.evict_host(host)

    # -- host writes from the CPU ----------------------------------------------------------------
    def scribble_free_host(self) -> Outcome:
        """The CPU writes into every host slot the harness's pools report free, while copies
        are queued (what a storage prefetch into freed slots does). A D2H that still writes a
        freed slot overwrites the scribble (seen by the watch, INV-07); an H2D that still reads
        one loads the scribble (seen by the device byte checks)."""
        written = self.watch.poison_free(
            "host",
            "INV-07",
            "a copy wrote host slots after they were freed (free host slots only once every "
            "copy into them landed: synchronize the write stream before the rollback frees)",
        )
        return done(f"scribbled {written} free host slot(s)")

    # -- reset ---------------------------------------------------------------------------------
    def reset(self) -> Outcome:
        """Tree reset at idle: controller reset, pools cleared, node ids restart at 0."""
        self.world.device.run_until_idle()
        self._reset_world()
        return done("reset")

    def reset_in_flight(self) -> Outcome:
        """Tree reset while copies are queued (capability ``reset_drains``): the forward batch
        at hand finishes, then every controller resets with its write and load copies still
        queued. Every free page and slot is then poisoned: a copy that lands after the reset
        (the reset did not wait for its streams) is caught in pages about to be reused."""
        self.world.forward_stream.synchronize()
        queued = not self.world.device.is_idle()
        self._reset_world()
        why = (
            "a copy queued before reset() landed after it (reset must synchronize the write "
            "and load streams before clearing its queues)"
        )
        pages = self.watch.poison_free("device", "INV-18", why)
        slots = self.watch.poison_free("host", "INV-18", why)
        return done(
            f"reset with copies {'queued' if queued else 'done'}; poisoned {pages} + {slots}"
        )

    def _reset_world(self) -> None:
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
        self.watch.clear()
        self.stores.clear()
        if self.storage is not None:
            self.storage.on_reset()  # the storage peers and the L3 records of the old epoch

    def _rows_backing_up(self, rank: int) -> dict[int, set[int]]:
        """The device rows each node being backed up holds on ``rank`` (the store watch)."""
        return {
            n.handle: set(self.geometry.placement(rank, n)[1].tolist())
            for n in self.nodes.values()
            if n.backup == "in_flight" and n.value is not None
        }

    # -- the harness's model, for the session's checks ------------------------------------------
    def model(self) -> HarnessModel:
        """What the tree recorded about its nodes' pages, as plain data (``invariants/``)."""
        page, ranks = self.config.page_size, len(self.world.ranks)
        nodes = tuple(
            compute_holdings(node, page, ranks, self.config.uses_cp) for node in self.nodes.values()
        )
        if self.storage is not None:  # host pages the storage driver holds (sources, buffers)
            nodes += self.storage.holdings()
        return HarnessModel(
            num_counters=self.config.num_counters,
            nodes=nodes,
            layer_num=self.config.layer_num,
            draft_layer_num=self.config.draft_layer_num,
        )
