"""Misuse probes: ask the controller to do something unsafe; it must refuse and change nothing.

in flight? (``write_in_flight`` / ``load_in_flight``: the node's copy may still run on a rank)
-> ``probe(kind, handle)`` on each rank that uses slots of the node -> the controller must
raise the invariant that guards the call: ``host_free`` (``evict_host``) INV-07 (or INV-15
for a pending per-layer write), ``device_free`` (``evict_device``) INV-08, ``rewrite`` (a second
backup) INV-02.

The tree never does these on its own, so without probes a controller that lost its guard would
pass every case (the mutants in fuzz/mutants/*ignores* / *during* show it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import as_reservation, is_write_failure
from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.steps.outcome import Outcome, done
from hicache_ref.harness.world.config import HarnessConfig

if TYPE_CHECKING:
    from hicache_ref.harness.adapters.base import CpControllerLike
    from hicache_ref.harness.driver.rank_geometry import RankGeometry
    from hicache_ref.harness.world.world import World

ProbeKind = Literal["host_free", "device_free", "rewrite"]
"""What a probe tries: free a node's host slots (``evict_host``), free its device pages
(``evict_device``), or back it up a second time."""
PROBE_REFUSALS: dict[ProbeKind, tuple[str, ...]] = {
    "host_free": ("INV-07", "INV-15"),
    "device_free": ("INV-08",),
    "rewrite": ("INV-02",),
}
"""The invariant ids a refusal of each probe may carry (the first is reported when accepted)."""


class ProbedTree(Protocol):
    """What the probes read of the tree driver that owns them, and the two verbs they borrow."""

    world: World
    config: HarnessConfig
    nodes: dict[int, Node]
    geometry: RankGeometry

    def evict_host_copies(self, node: Node, ranks: tuple[int, ...]) -> None: ...
    def cp_controllers(self) -> list[CpControllerLike]: ...


class MisuseProbes:
    """The probes of one tree driver (they read its nodes and call its ranks' controllers)."""

    def __init__(self, tree: ProbedTree) -> None:
        self.tree = tree
        self.world = tree.world
        self.config = tree.config

    def write_in_flight(self, handle: int, rank: int | None = None) -> bool:
        """Whether the node's backup copy may still run on ``rank`` (any rank when None)."""
        node = self.tree.nodes[handle]
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
        node = self.tree.nodes[handle]
        if not node.loading or node.producer_id is None:
            return False
        ranks = range(len(self.world.ranks)) if rank is None else (rank,)
        return any(
            node.node_id in ack.node_ids and not ack.finish_event.query()
            for r in ranks
            for ack in self.world.ranks[r].controller.ack_load_queue
        )

    def probe(self, kind: ProbeKind, handle: int) -> Outcome:
        """Try ``kind`` on every rank whose copy of the node is in flight; each must refuse."""
        node = self.tree.nodes[handle]
        expected = PROBE_REFUSALS[kind]
        for rank_index in range(len(self.world.ranks)):
            if not self._rank_uses_slots(kind, node, rank_index):
                continue  # this rank copies nothing for the node: there is nothing to protect
            busy = self.write_in_flight(handle, rank_index) or (
                kind == "device_free" and self.load_in_flight(handle, rank_index)
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
        return done(f"probe {kind} node {handle}: refused")

    def _rank_uses_slots(self, kind: ProbeKind, node: Node, rank_index: int) -> bool:
        if not self.config.uses_cp or kind == "rewrite":
            return True
        if kind == "host_free":
            # the harness's own layout says whether this rank holds host slots of the node
            return node.cp_meta[rank_index] is not None and bool(
                len(node.owned_positions[rank_index])
            )
        assert node.value is not None
        return bool(len(self.tree.geometry.placement(rank_index, node)[0]))

    def _probe_call(self, kind: ProbeKind, node: Node, rank_index: int) -> str:
        controller = self.world.ranks[rank_index].controller
        assert kind == "host_free" or node.value is not None
        if kind == "host_free":
            self.tree.evict_host_copies(node, (rank_index,))
        elif kind == "device_free" and node.value is not None:
            controller.evict_device(node.value)
        elif self.config.uses_cp and node.value is not None:
            cp = self.tree.cp_controllers()[rank_index]
            result = cp.reserve_write_cp(node.value, node_id=node.node_id)
            if is_write_failure(result) and result.reason == "undrained_ack":
                return "refused"
            reservation = as_reservation(result)
            if reservation is not None:
                cp.evict_cp_host(reservation.metadata)  # undo, then report the acceptance
        elif node.value is not None:
            controller.write(node.value, node_id=node.node_id)
        return "accepted"
