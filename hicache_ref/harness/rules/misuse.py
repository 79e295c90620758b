"""The misuse family: the harness asks for something unsafe, and the controller must refuse.

in flight? (``write_in_flight`` / ``load_in_flight``: the node's copy may still run on a rank)
-> ``probe(kind, handle)`` on each rank that uses slots of the node -> the controller must
raise the invariant that guards the call: ``probe_evict_host`` (``evict_host``; first, on its
own, an independent side pool's host release) INV-07 (or INV-15 for a pending per-layer
write), ``probe_evict_device`` (``evict_device``) INV-08,
``probe_rewrite`` (a second backup) INV-02 -> ``scribble_free_host``: the CPU writes into every
free host slot while copies are queued (a copy still writing a freed slot overwrites it).

The tree never does these on its own, so without probes a controller that lost its guard would
pass every case (the mutants in fuzz/mutants/*ignores* / *during* show it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import as_reservation, is_write_failure
from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.evict import evict_host_copies
from hicache_ref.harness.rules.record import (
    NODE_ARG,
    Args,
    Completion,
    Draw,
    RuleRecord,
    StepContext,
    candidate_rule,
    copies_queued,
    device_busy,
    no_args,
    no_oracle_ops,
    node_arg,
    pick_draw,
)
from hicache_ref.harness.step_types import Outcome, done

ProbeKind = Literal["host_free", "device_free", "rewrite"]
"""What a probe tries: free a node's host slots (``evict_host``), free its device pages
(``evict_device``), or back it up a second time."""
PROBE_REFUSALS: dict[ProbeKind, tuple[str, ...]] = {
    "host_free": ("INV-07", "INV-15"),
    "device_free": ("INV-08",),
    "rewrite": ("INV-02",),
}
"""The invariant ids a refusal of each probe may carry (the first is reported when accepted)."""


# -- the probes ---------------------------------------------------------------------------------
def write_in_flight(tree: TreeDriver, handle: int, rank: int | None = None) -> bool:
    """Whether the node's backup copy may still run on ``rank`` (any rank when None)."""
    node = tree.nodes[handle]
    ranks = range(len(tree.world.ranks)) if rank is None else (rank,)
    for r in ranks:
        controller = tree.world.ranks[r].controller
        per_layer = tree.world.ranks[r].per_layer
        if per_layer is not None and node.node_id in per_layer.pending_layer_writes:
            return True
        for ack in controller.ack_write_queue:
            if node.node_id in ack.node_ids and not ack.finish_event.query():
                return True
    return False


def load_in_flight(tree: TreeDriver, handle: int, rank: int | None = None) -> bool:
    node = tree.nodes[handle]
    if not node.loading or node.producer_id is None:
        return False
    ranks = range(len(tree.world.ranks)) if rank is None else (rank,)
    return any(
        node.node_id in ack.node_ids and not ack.finish_event.query()
        for r in ranks
        for ack in tree.world.ranks[r].controller.ack_load_queue
    )


def probe(tree: TreeDriver, kind: ProbeKind, handle: int) -> Outcome:
    """Try ``kind`` on every rank whose copy of the node is in flight; each must refuse."""
    node = tree.nodes[handle]
    expected = PROBE_REFUSALS[kind]
    for rank_index in range(len(tree.world.ranks)):
        if not _rank_uses_slots(tree, kind, node, rank_index):
            continue  # this rank copies nothing for the node: there is nothing to protect
        busy = write_in_flight(tree, handle, rank_index) or (
            kind == "device_free" and load_in_flight(tree, handle, rank_index)
        )
        if kind != "rewrite" and not busy:
            continue  # this rank's copy already landed: freeing would be legitimate here
        try:
            outcome = _probe_call(tree, kind, node, rank_index)
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


def _rank_uses_slots(tree: TreeDriver, kind: ProbeKind, node: Node, rank_index: int) -> bool:
    if not tree.config.uses_cp or kind == "rewrite":
        return True
    if kind == "host_free":
        # the harness's own layout says whether this rank holds host slots of the node
        return node.cp_meta[rank_index] is not None and bool(len(node.owned_positions[rank_index]))
    assert node.value is not None
    return bool(len(tree.geometry.placement(rank_index, node)[0]))


def _probe_call(tree: TreeDriver, kind: ProbeKind, node: Node, rank_index: int) -> str:
    controller = tree.world.ranks[rank_index].controller
    assert kind == "host_free" or node.value is not None
    if kind == "host_free":
        if _side_host_release_accepted(tree, node, rank_index):
            return "accepted"
        evict_host_copies(tree, node, (rank_index,))
    elif kind == "device_free" and node.value is not None:
        controller.evict_device(node.value)
    elif tree.config.uses_cp and node.value is not None:
        cp = tree.cp_controllers()[rank_index]
        result = cp.reserve_write_cp(node.value, node_id=node.node_id)
        if is_write_failure(result) and result.reason == "undrained_ack":
            return "refused"
        reservation = as_reservation(result)
        if reservation is not None:
            cp.evict_cp_host(reservation.metadata)  # undo, then report the acceptance
    elif node.value is not None:
        controller.write(node.value, node_id=node.node_id)
    return "accepted"


def _side_host_release_accepted(tree: TreeDriver, node: Node, rank_index: int) -> bool:
    """An independent side pool's host slots on their own first: each pool's release must
    refuse by itself (the anchor's refusal would otherwise hide an unguarded side release).
    A refusal with another id than the probe's propagates."""
    sides = tree.world.ranks[rank_index].sides
    side_host = node.side_host[rank_index] if node.side_host else None
    if sides is None or side_host is None:
        return False
    try:
        sides.evict_host(side_host)
    except InvariantViolation as refusal:
        if refusal.inv_id not in PROBE_REFUSALS["host_free"]:
            raise
        return False
    return True


def _probe_rule(rule: str, what: str) -> Callable[[StepContext, Args], str | None]:
    in_candidates = candidate_rule(rule, what)

    def why_not(ctx: StepContext, args: Args) -> str | None:
        if "guards" not in ctx.capabilities:
            return "the implementation refuses nothing (no guards): probes are off"
        return in_candidates(ctx, args)

    return why_not


def _process_probe(kind: ProbeKind) -> Callable[[StepContext, Args], Outcome]:
    return lambda ctx, args: probe(ctx.tree, kind, node_arg(args))


PROBES_IN_FLIGHT = Completion(in_flight=("write", "load"))


# -- probe_evict_host ---------------------------------------------------------------------------
def _candidates_probe_evict_host(ctx: StepContext) -> list[int]:
    t = ctx.tree
    return [h for h in t.handles(lambda n: n.backup == "in_flight") if write_in_flight(t, h)]


PROBE_EVICT_HOST = RuleRecord(
    "probe_evict_host",
    "misuse",
    "evict_host of a node whose backup is in flight: must be refused (INV-07/INV-15)",
    _probe_rule("probe_evict_host", "backing up with its copy in flight"),
    _process_probe("host_free"),
    candidates=_candidates_probe_evict_host,
    draw=pick_draw("probe_evict_host"),
    oracle=no_oracle_ops,  # refused: it changes nothing (INV-17)
    weight=1,
    probe=True,
    args=NODE_ARG,
    completion=Completion(in_flight=("write",)),  # its backup's copy
)


# -- probe_evict_device -------------------------------------------------------------------------
def _candidates_probe_evict_device(ctx: StepContext) -> list[int]:
    t = ctx.tree
    return [
        h for h in t.handles(lambda n: n.on_device) if write_in_flight(t, h) or load_in_flight(t, h)
    ]


PROBE_EVICT_DEVICE = RuleRecord(
    "probe_evict_device",
    "misuse",
    "evict_device of a node whose copy is in flight: must be refused (INV-08)",
    _probe_rule("probe_evict_device", "on device with a copy in flight"),
    _process_probe("device_free"),
    candidates=_candidates_probe_evict_device,
    draw=pick_draw("probe_evict_device"),
    oracle=no_oracle_ops,
    weight=1,
    probe=True,
    args=NODE_ARG,
    completion=PROBES_IN_FLIGHT,
)


# -- probe_rewrite ------------------------------------------------------------------------------
def _candidates_probe_rewrite(ctx: StepContext) -> list[int]:
    return ctx.tree.handles(lambda n: n.backup == "in_flight" and n.on_device)


PROBE_REWRITE = RuleRecord(
    "probe_rewrite",
    "misuse",
    "a second backup of a node whose backup is in flight: must be refused (INV-02)",
    _probe_rule("probe_rewrite", "on device with its backup in flight"),
    _process_probe("rewrite"),
    candidates=_candidates_probe_rewrite,
    draw=pick_draw("probe_rewrite"),
    oracle=no_oracle_ops,
    weight=1,
    probe=True,
    args=NODE_ARG,
)


# -- scribble_free_host -------------------------------------------------------------------------
def scribble_free_host(tree: TreeDriver) -> Outcome:
    """The CPU writes into every host slot the harness's pools report free, while copies
    are queued (what a storage prefetch into freed slots does). A D2H that still writes a
    freed slot overwrites the scribble (seen by the watch, INV-07); an H2D that still reads
    one loads the scribble (seen by the device byte checks)."""
    written = tree.watch.poison_free(
        "host",
        "INV-07",
        "a copy wrote host slots after they were freed (free host slots only once every "
        "copy into them landed: synchronize the write stream before the rollback frees)",
    )
    return done(f"scribbled {written} free host slot(s)")


def _rule_scribble_free_host(ctx: StepContext, args: Args) -> str | None:
    return None if device_busy(ctx) else "no copy is queued (a scribble would race nothing)"


def _offered_scribble(ctx: StepContext) -> bool:
    """While a scribble is watched a new one adds little (the machine waits for its horizon)."""
    return copies_queued(ctx) and not ctx.tree.watch.active


SCRIBBLE_FREE_HOST = RuleRecord(
    "scribble_free_host",
    "eviction",
    "the CPU writes into every free host slot while copies are queued",
    _rule_scribble_free_host,
    lambda ctx, args: scribble_free_host(ctx.tree),
    draw=Draw({}, no_args, _offered_scribble),
    oracle=no_oracle_ops,  # free slots only, whose content the oracle does not predict
    completion=PROBES_IN_FLIGHT,
)

RECORDS: tuple[RuleRecord, ...] = (
    SCRIBBLE_FREE_HOST,
    PROBE_EVICT_HOST,
    PROBE_EVICT_DEVICE,
    PROBE_REWRITE,
)
