"""The tree-side driver: the radix cache's state around the controller, and its ack drains.

It owns the radix nodes (``node_model.py``; a flat table: the harness needs lifecycles, not
prefix matching), the writes and loads in flight by node id, the loads queued for the next
``start_loading``, and the forward batch being computed; what the rules' verbs do to them is in
the rule families (``rules/forward.py`` ... ``rules/reset.py``), each verb a function of this
driver returning an ``Outcome``. Here stays what every family shares:

- the ranks' controllers as each contract (``controllers``, ``cp_controllers``,
  ``per_layer_controllers``) and the forward's stream (``on_forward``);
- where bytes live per rank (``rank_geometry.py``), every byte comparison and the free-slot
  poison (``byte_checks.py``), the store watch (``store_watch.py``);
- the ack drains, as the scheduler does them: only a FIFO prefix of completed acks, MIN over
  CP ranks (``writing_check`` / ``loading_check``: a drained ack's node must be in flight, its
  bytes must have landed);
- ``model``: what the tree recorded of its nodes' pages, for the session's checks.

The driver calls implementations only through the contract of ``adapters/base.py`` and trusts
none of their bookkeeping: where a node's bytes live on each rank (owned positions, padding,
page owners) is computed from the harness's own CP layout; from the implementation it takes only
the host slots it chose, and checks their number (INV-13). It knows nothing of the storage tier:
the L3 side (``storage_driver.py``) reads and extends the tree, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from itertools import islice

import torch

from hicache_ref.harness.adapters.base import (
    AckQueue,
    ControllerLike,
    CpControllerLike,
    PerLayerWriteLike,
)
from hicache_ref.harness.driver.byte_checks import ByteChecks, DeferredReads, FreeSlotWatch
from hicache_ref.harness.driver.node_model import (
    Node,
    compute_holdings,
    handle_of,
    pages_covered,
)
from hicache_ref.harness.driver.rank_geometry import RankGeometry
from hicache_ref.harness.driver.store_watch import StoreWatch
from hicache_ref.harness.step_types import Outcome, done
from hicache_ref.harness.world.world import World
from hicache_ref.invariants.evidence import DrainedAck, PoolIndices, RankValues, StateSlots
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.snapshot import HarnessModel, NodeHoldings

__all__ = ["Node", "TreeDriver", "handle_of"]


def _held_pages(node: Node, field: str, page: int) -> frozenset[int]:
    """The pages a node holds through one of its fields (a tensor, or one per rank)."""
    value = getattr(node, field)
    tensors = value if isinstance(value, list) else [value]
    held: set[int] = set()
    for tensor in tensors:
        if tensor is not None:
            held |= pages_covered(tensor, page)
    return frozenset(held)


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

    def controllers(self) -> list[ControllerLike]:
        return [rank.controller for rank in self.world.ranks]

    def cp_controllers(self) -> list[CpControllerLike]:
        """Every rank's controller as the CP contract (only on a CP world)."""
        out = [rank.cp for rank in self.world.ranks]
        assert all(c is not None for c in out), "CP verbs on a world without CP"
        return [c for c in out if c is not None]

    def per_layer_controllers(self) -> list[PerLayerWriteLike]:
        """Every rank's controller as the per-layer contract (empty without per_layer_write)."""
        return [rank.per_layer for rank in self.world.ranks if rank.per_layer is not None]

    def on_forward(self) -> AbstractContextManager[object]:
        """The forward's stream: its own under overlap scheduling (``config.forward_stream``)."""
        return self.world.device.stream(self.world.forward_stream)

    def leave_batch(self, handle: int) -> None:
        """A node evicted or dropped leaves the forward batch (an aborted request)."""
        if handle in self.batch:
            self.batch.remove(handle)
            if not self.batch:
                self.batch_layer = 0

    def check_host_bytes(self, node: Node, inv_id: str, when: str) -> None:
        self.bytes.check_host_bytes(node, inv_id, when)

    def check_device_bytes(self, node: Node, inv_id: str, when: str) -> None:
        self.bytes.check_device_bytes(node, inv_id, when)

    def has_pending_layer_write(self, handle: int) -> bool:
        node = self.nodes[handle]
        return any(node.node_id in c.pending_layer_writes for c in self.per_layer_controllers())

    def check_state_slots(self, node: Node, kind: str, side: torch.Tensor, what: str) -> None:
        """What a backup (``kind="host"``) or load (``"device"``) handed the node in a state
        pool (Mamba): its one state slot, as the harness's geometry counts it (INV-40)."""
        if not self.config.has_state_pool:
            return
        expected = self.config.side_rows(node.logical_len)
        self.checks.run("INV-40", StateSlots(f"side {kind}", side, expected, what))

    def check_group_indices(
        self, node: Node, kind: str, anchor: torch.Tensor, side: torch.Tensor, what: str
    ) -> None:
        """What a backup (``kind="host"``) or load (``"device"``) in an independent side-pool
        world handed the node, each pool's from its own allocator and no other node's (INV-36):
        judged against the harness's pools and the tree's other nodes, never the controller."""
        rank = self.world.ranks[0]
        page, side_page = self.config.page_size, self.config.side_page_size  # each pool's own
        others = [n for n in self.nodes.values() if n.handle != node.handle]
        if kind == "host":
            assert rank.draft_host_pool is not None
            pools = (
                ("anchor host", anchor, rank.host_pool.allocated_pages(), "host_value", page),
                ("side host", side, rank.draft_host_pool.allocated_pages(), "side_host", side_page),
            )
        else:
            assert rank.side_allocator is not None
            pools = (
                ("anchor device", anchor, rank.allocator.allocated_page_ids(), "value", page),
                (
                    "side device",
                    side,
                    rank.side_allocator.allocated_page_ids(),
                    "side_value",
                    side_page,
                ),
            )
        for pool, indices, allocated, field, page in pools:
            held = frozenset(p for n in others for p in _held_pages(n, field, page))
            evidence = PoolIndices(pool, indices, page, frozenset(allocated), held, what)
            self.checks.run("INV-36", evidence)

    # -- ack drains ----------------------------------------------------------------------------
    @staticmethod
    def _queue(controller: ControllerLike, queue_name: str) -> AckQueue:
        if queue_name == "ack_write_queue":
            return controller.ack_write_queue
        return controller.ack_load_queue

    def _ready_prefix(self, queue_name: str) -> int:
        """Leading acks whose finish event completed, MIN over ranks (FIFO prefix, INV-09)."""
        counts = []
        for controller in self.controllers():
            count = 0
            for ack in self._queue(controller, queue_name):
                if not ack.finish_event.query():
                    break
                count += 1
            counts.append(count)
        return min(counts)

    def _pop_rows(self, queue_name: str, count: int) -> list[list[int]]:
        rows_per_rank = []
        for controller in self.controllers():
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

    def _release_request_slot(self, node: Node) -> None:
        """A drained load's copy-on-write state slot (``state_cow``): it holds the node's state
        as the load copied it (INV-09), then goes back to the state allocator (the request is
        done with it)."""
        request = node.side_request
        if request is None:
            return
        self.bytes.check_request_bytes(node, request, "INV-09", "load ack drained")
        allocator = self.world.ranks[0].side_allocator
        assert allocator is not None
        allocator.free(request)
        node.side_request = None

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
                self._release_request_slot(node)
        return done(f"drained {len(rows)} load ack(s)")

    def _rows_backing_up(self, rank: int, pool: str) -> dict[int, set[int]]:
        """The device rows of ``pool`` (``target`` or ``draft``) each node being backed up
        holds on ``rank`` (the store watch)."""
        draft = pool == "draft"
        return {
            n.handle: set(self.geometry.placement(rank, n, draft)[1].tolist())
            for n in self.nodes.values()
            if n.backup == "in_flight" and n.value is not None
        }

    # -- the harness's model, for the session's checks ------------------------------------------
    def model(self, held: tuple[NodeHoldings, ...] = ()) -> HarnessModel:
        """What the tree recorded about its nodes' pages, as plain data (``invariants/``);
        ``held``: host pages others hold beside the nodes (the storage driver's sources and
        bounce buffers)."""
        page, ranks = self.config.page_size, len(self.world.ranks)
        nodes = tuple(
            compute_holdings(node, page, ranks, self.config.uses_cp, self.config.side_page_size)
            for node in self.nodes.values()
        )
        return HarnessModel(
            num_counters=self.config.num_counters,
            nodes=nodes + held,
            layer_num=self.config.layer_num,
            draft_layer_num=self.config.draft_layer_num,
        )
