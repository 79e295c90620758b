"""The write family: a device node backed up to host, and the ways a backup ends early.

``write`` (a computed node: ``write`` without CP, else ``reserve_cp``: reserve on every rank,
agree, submit) -> ``start_writing`` (flush queued writes) -> ``drain_write`` (the ready prefix
of the write acks) ; ``reserve`` (an early CP reservation) -> ``submit_layer`` (one layer of
it) ; ``cancel`` (roll a pending per-layer backup back, then free its host slots). A backup's
ack is drained by the tree (``TreeDriver.writing_check``), which checks the host bytes.
"""

from __future__ import annotations

import torch

from hicache_ref.harness.adapters.base import as_reservation, is_write_failure
from hicache_ref.harness.driver.node_model import Node, handle_of
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.record import (
    NODE_ARG,
    NODE_LAYER_ARGS,
    Args,
    Completion,
    Draw,
    OracleView,
    RuleRecord,
    StepContext,
    always,
    candidate_rule,
    draw_only_outside_machine,
    needs_per_layer_write,
    no_args,
    no_oracle_ops,
    node_arg,
    offered_always,
    oracle_drains,
    pick_draw,
    pool_arg,
)
from hicache_ref.harness.step_types import Outcome, done, refused
from hicache_ref.invariants.evidence import ReturnedIndices
from hicache_ref.oracle import ops as o


# -- write --------------------------------------------------------------------------------------
def _candidates_write(ctx: StepContext) -> list[int]:
    total = ctx.tree.total_layers
    return ctx.tree.handles(
        lambda n: n.on_device and n.layers_stored == total and n.backup == "none"
    )


def write_backup(tree: TreeDriver, handle: int) -> Outcome:
    """Back up a computed device node: ``write`` on one rank, or a CP reservation on all."""
    node = tree.nodes[handle]
    assert node.value is not None and node.backup == "none"
    if tree.config.uses_cp:
        return reserve_cp(tree, node, catch_up=True)
    rank = tree.world.ranks[0]
    side_host = None
    host: object
    if rank.sides is not None:  # the side pool named beside the anchor (its own rows)
        assert node.side_value is not None
        both = rank.sides.write(node.value, node.node_id, node.side_value)
        if both is None:
            return refused("host full")
        host, side_host = both
        what = f"write of node {handle}"
        tree.check_state_slots(node, "host", side_host, what)  # INV-40: one state slot
        tree.check_group_indices(node, "host", host, side_host, what)  # INV-36
    else:
        host = rank.controller.write(node.value, node_id=node.node_id)
    if host is None:
        return refused("host full")
    assert isinstance(host, torch.Tensor), "a non-CP write returns host indices or None"
    page = tree.config.page_size
    tree.checks.run("INV-01", ReturnedIndices(host, page, f"write of node {handle}"))
    node.host_value[0] = host
    text = f"write node {handle} -> host {host.numel()} slots"
    if side_host is not None:
        what = f"write of node {handle} (side pool)"
        side_page = tree.config.side_page_size  # a state pool's page is one slot
        tree.checks.run("INV-01", ReturnedIndices(side_host, side_page, what))
        node.side_host[0] = side_host
        text += f", side host {side_host.numel()} slots"
    _start_backup(tree, node)
    return done(text)


def reserve_cp(tree: TreeDriver, node: Node, *, catch_up: bool) -> Outcome:
    """Reserve on every rank, agree, then submit: a rank-local failure must not ack alone."""
    assert node.value is not None
    assert catch_up or tree.world.per_layer_write, "early reservations need per_layer_write"
    controllers = tree.cp_controllers()
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
    tree.geometry.record_layout(node)
    for rank_index in range(len(controllers)):
        tree.geometry.check_reservation(rank_index, node)  # INV-01, INV-13
    per_layer = tree.per_layer_controllers()
    for rank_index, reservation in enumerate(held):
        if per_layer:
            per_layer[rank_index].submit_write_cp_per_layer(
                reservation, catch_up_all_layers=catch_up
            )
        else:  # no per_layer_write: one all-layer D2H per rank
            controllers[rank_index].submit_write_cp_all_layer(reservation)
    node.reservations = held
    _start_backup(tree, node)
    return done(f"reserve node {handle_of(node)} on {len(results)} rank(s)")


def _start_backup(tree: TreeDriver, node: Node) -> None:
    node.backup = "in_flight"
    tree.ongoing_write[node.node_id] = node.handle


def process_write(ctx: StepContext, args: Args) -> Outcome:
    return write_backup(ctx.tree, node_arg(args))


def _oracle_write(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [view.backup_op(node_arg(args), outcome.refused, early=False)]


WRITE = RuleRecord(
    "write",
    "write path",
    "back up a computed device node (write / reserve_write_cp + submit)",
    candidate_rule("write", "on device, computed and not backed up"),
    process_write,
    candidates=_candidates_write,
    draw=pick_draw("write"),
    oracle=_oracle_write,
    weight=6,
    reserves=True,
    refusable=True,
    args=NODE_ARG,
    walk=4.0,
    returns="host_slots",
)


# -- start_writing ------------------------------------------------------------------------------
def process_start_writing(ctx: StepContext, args: Args) -> Outcome:
    for rank in ctx.world.ranks:
        rank.controller.start_writing()
    return done("start_writing")


START_WRITING = RuleRecord(
    "start_writing",
    "write path",
    "flush queued writes",
    always,
    process_start_writing,
    draw=draw_only_outside_machine(Draw({}, no_args, offered_always)),
    oracle=no_oracle_ops,  # write() and the CP writes already issued their copies
    weight=1,
)


# -- reserve ------------------------------------------------------------------------------------
def _rule_reserve(ctx: StepContext, args: Args) -> str | None:
    node = ctx.tree.node(node_arg(args))
    if (why := needs_per_layer_write(ctx)) is not None:
        return why
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if not ctx.config.uses_cp or node.backup != "none" or node.loading:
        return f"node {node_arg(args)} has a backup or is loading (or the world has no CP)"
    return None


def process_reserve(ctx: StepContext, args: Args) -> Outcome:
    """Early CP reservation of an existing node (catch_up_all_layers=False)."""
    return reserve_cp(ctx.tree, ctx.tree.nodes[node_arg(args)], catch_up=False)


def _oracle_reserve(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [view.backup_op(node_arg(args), outcome.refused, early=True)]


RESERVE = RuleRecord(
    "reserve",
    "write path",
    "an early CP reservation of an existing node",
    _rule_reserve,
    process_reserve,
    oracle=_oracle_reserve,
    reserves=True,
    refusable=True,
    args=NODE_ARG,
    walk=0.0,  # oracle traces only (``steps/programs.py`` reaches it in the CP processes)
    returns="host_slots",
)


# -- submit_layer -------------------------------------------------------------------------------
def _rule_submit_layer(ctx: StepContext, args: Args) -> str | None:
    node = ctx.tree.node(node_arg(args))
    if (why := needs_per_layer_write(ctx)) is not None:
        return why
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if not node.reservations or node.backup != "in_flight":
        return f"node {node_arg(args)} has no reservation in flight"
    return None


def submit_layer(tree: TreeDriver, handle: int, layer: int, draft: bool) -> Outcome:
    node = tree.nodes[handle]
    controllers = tree.per_layer_controllers()
    for controller, reservation in zip(controllers, node.reservations, strict=True):
        controller.submit_write_cp_layer(
            reservation, layer, submit_target=not draft, submit_draft=draft
        )
    return done(f"submit {'draft' if draft else 'target'} layer {layer} of node {handle}")


def process_submit_layer(ctx: StepContext, args: Args) -> Outcome:
    return submit_layer(ctx.tree, node_arg(args), int(args["layer"]), bool(args["draft"]))


def _oracle_submit_layer(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.SubmitLayer(view.node_id(node_arg(args)), int(args["layer"]), pool_arg(args))]


SUBMIT_LAYER = RuleRecord(
    "submit_layer",
    "write path",
    "submit one layer of a reserved node",
    _rule_submit_layer,
    process_submit_layer,
    oracle=_oracle_submit_layer,
    args=NODE_LAYER_ARGS,
    walk=0.0,  # oracle traces only
)


# -- drain_write --------------------------------------------------------------------------------
DRAIN_WRITE = RuleRecord(
    "drain_write",
    "write path",
    "drain the ready prefix of the write acks",
    always,
    lambda ctx, args: ctx.tree.writing_check(),
    draw=draw_only_outside_machine(Draw({}, no_args, offered_always)),
    oracle=oracle_drains(write=True, load=False),
    weight=2,
    completion=Completion(drains=("write",)),
    walk=1.5,
)


# -- cancel -------------------------------------------------------------------------------------
def _candidates_cancel(ctx: StepContext) -> list[int]:
    t = ctx.tree
    return [h for h in t.handles(lambda n: n.backup == "in_flight") if t.has_pending_layer_write(h)]


def cancel_backup(tree: TreeDriver, handle: int) -> Outcome:
    """Roll back a pending per-layer backup: cancel, then free the reserved host slots."""
    node = tree.nodes[handle]
    per_layer = tree.per_layer_controllers()
    for rank_index, controller in enumerate(tree.cp_controllers()):
        per_layer[rank_index].cancel_layer_write_state(node.node_id)
        controller.evict_cp_host(tree.geometry.meta(node, rank_index))
    node.backup = "none"
    node.cp_meta = [None] * len(tree.world.ranks)
    node.reservations = []
    tree.ongoing_write.pop(node.node_id, None)
    return done(f"cancelled backup of node {handle}")


def process_cancel(ctx: StepContext, args: Args) -> Outcome:
    return cancel_backup(ctx.tree, node_arg(args))


def _oracle_cancel(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.CancelLayerWrite(view.node_id(node_arg(args)))]


CANCEL = RuleRecord(
    "cancel",
    "write path",
    "roll back a pending per-layer backup, then free its host slots",
    candidate_rule("cancel", "backing up with a pending per-layer write"),
    process_cancel,
    candidates=_candidates_cancel,
    draw=pick_draw("cancel"),
    oracle=_oracle_cancel,
    feeds_first=True,  # the rollback synchronizes the write stream first
    weight=2,
    args=NODE_ARG,
)

RECORDS: tuple[RuleRecord, ...] = (
    WRITE,
    START_WRITING,
    RESERVE,
    SUBMIT_LAYER,
    DRAIN_WRITE,
    CANCEL,
)
