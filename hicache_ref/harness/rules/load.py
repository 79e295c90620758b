"""The load family: a host-only node back on device, read by the forward while it loads.

``load`` (``load`` / ``load_cp``: new device pages, the copy queued) -> ``start_loading`` (the
queued loads start on one producer slot) -> ``forward_read`` / ``forward_read_batch`` (the
forward waits on the slot's layer event, then reads the layer: the bytes must be the node's)
-> ``drain_load`` (the ready prefix of the load acks) ; ``drain_acks`` (the scheduler's check:
both queues). A load ack is drained by the tree (``TreeDriver.loading_check``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch

from hicache_ref.harness.driver.node_model import FORWARD_META, CpNodeView, ForwardKernel, Node
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.record import (
    BOTH_QUEUES,
    MULTI_CONSUMER,
    NODE_ARG,
    NODE_LAYER_ARGS,
    PICK,
    Args,
    Bools,
    Completion,
    Draw,
    IntLists,
    Ints,
    OracleView,
    RuleRecord,
    StepContext,
    always,
    candidate_rule,
    draw_only_outside_machine,
    layer_in_range,
    layer_limit,
    no_args,
    node_arg,
    offered_always,
    oracle_drains,
    parse_handles,
    pick_candidate,
    pick_draw,
    pool_arg,
    undrained_loads,
)
from hicache_ref.harness.step_types import Outcome, StepArg, done, refused
from hicache_ref.invariants.evidence import RankValues, SlotReuse
from hicache_ref.oracle import ops as o


@runtime_checkable
class MultiConsumerCounterLike(Protocol):
    """``layer_done_counter`` with capability ``multi_consumer``: one forward batch waits on
    the layer events of several producer slots (the reference's and the seed's counters)."""

    def set_consumer(self, index: int | Sequence[int], /) -> None: ...


# -- load ---------------------------------------------------------------------------------------
def _candidates_load(ctx: StepContext) -> list[int]:
    if undrained_loads(ctx) + 1 > ctx.config.num_counters:
        return []
    return ctx.tree.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)


def load_back(tree: TreeDriver, handle: int) -> Outcome:
    """New device pages for a host-only node on every rank, its H2D queued (not started)."""
    node = tree.nodes[handle]
    assert node.value is None and node.backup == "done" and not node.loading
    results: list[torch.Tensor | None] = []
    if tree.config.uses_cp:
        for rank_index, cp in enumerate(tree.cp_controllers()):
            view = CpNodeView(node.node_id, node.logical_len, tree.geometry.meta(node, rank_index))
            results.append(cp.load_cp([view], node_id=node.node_id))
    elif tree.config.has_side_pools:
        return _load_with_sides(tree, node)
    else:
        for rank_index, controller in enumerate(tree.controllers()):
            host = node.host_value[rank_index]
            assert host is not None
            results.append(controller.load(host, node_id=node.node_id))
    if all(r is None for r in results):
        return refused("device full")
    allocations = [r for r in results if r is not None]
    if len(results) > 1:
        rows = [[r.tolist() if r is not None else []] for r in results]
        tree.checks.run("INV-14", RankValues("the load_cp allocations", rows, ack_rows=False))
    node.value = allocations[0]
    if tree.config.uses_cp:
        tree.geometry.check_owner_replay(node)
    node.loading = True
    tree.ongoing_load[node.node_id] = handle
    tree.queued_loads.append(handle)
    return done(f"load node {handle} -> {allocations[0].numel()} locs")


def _load_with_sides(tree: TreeDriver, node: Node) -> Outcome:
    """A node loaded into fresh rows of the anchor and of its independent side pool (one rank:
    side pools are drawn without CP); the side rows are the ones the controller allocated."""
    rank = tree.world.ranks[0]
    host, side_host = node.host_value[0], node.side_host[0]
    assert rank.sides is not None and host is not None and side_host is not None
    request = None
    if tree.config.state_cow:  # the request's own state slot first (prepare_load_back)
        assert rank.side_allocator is not None
        request = rank.side_allocator.alloc(1)
        if request is None:
            return refused("state pool full (no slot for the request)")
        both = rank.sides.load(host, node.node_id, side_host, request)
    else:
        both = rank.sides.load(host, node.node_id, side_host)
    if both is None:
        if request is not None:  # finalize_load_back(success=False): the slot goes back
            rank.side_allocator.free(request)  # type: ignore[union-attr]
        return refused("device full")
    node.side_request = request
    what = f"load of node {node.handle}"
    tree.check_state_slots(node, "device", both[1], what)  # INV-40: one state slot
    tree.check_group_indices(node, "device", *both, what)  # INV-36
    node.value, node.side_value = both
    node.loading = True
    tree.ongoing_load[node.node_id] = node.handle
    tree.queued_loads.append(node.handle)
    rows = both[1].numel()
    text = f"load node {node.handle} -> {both[0].numel()} locs, side {rows} rows"
    return done(text + (", and the request's state slot" if request is not None else ""))


def process_load(ctx: StepContext, args: Args) -> Outcome:
    return load_back(ctx.tree, node_arg(args))


def _oracle_load(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [] if outcome.refused else [view.load_op(node_arg(args))]


LOAD = RuleRecord(
    "load",
    "load path",
    "load a host-only node back (load / load_cp)",
    candidate_rule("load", "host only and not loading, with a producer slot free"),
    process_load,
    candidates=_candidates_load,
    draw=pick_draw("load"),
    oracle=_oracle_load,
    weight=4,
    refusable=True,
    args=NODE_ARG,
    walk=4.0,
    returns="device_pages",
)


# -- start_loading ------------------------------------------------------------------------------
def _rule_start_loading(ctx: StepContext, args: Args) -> str | None:
    if not ctx.tree.queued_loads:
        return "no load is queued"
    if undrained_loads(ctx) >= ctx.config.num_counters:
        return "every producer slot is held by an undrained load ack (INV-10)"
    return None


def start_loading(tree: TreeDriver) -> Outcome:
    """Start the queued loads on one producer slot (every rank must hand out the same)."""
    ids = [controller.start_loading() for controller in tree.controllers()]
    if len(ids) > 1:
        slots = RankValues("the producer slots", [[[i]] for i in ids], ack_rows=False)
        tree.checks.run("INV-14", slots)
    busy = sorted(
        n.handle
        for n in tree.nodes.values()
        if n.loading and n.producer_id == ids[0] and n.handle not in tree.queued_loads
    )
    tree.checks.run("INV-10", SlotReuse(ids[0], busy))
    for handle in tree.queued_loads:
        if handle in tree.nodes:
            tree.nodes[handle].producer_id = ids[0]
    tree.queued_loads.clear()
    return done(f"start_loading -> producer {ids[0]}")


START_LOADING = RuleRecord(
    "start_loading",
    "load path",
    "start the queued loads on one producer slot",
    _rule_start_loading,
    lambda ctx, args: start_loading(ctx.tree),
    draw=Draw({}, no_args, lambda s: bool(s.tree.queued_loads)),
    oracle=lambda view, args, outcome: [o.StartLoading()],
    weight=4,
    walk=4.0,
)


# -- forward_read -------------------------------------------------------------------------------
def _candidates_forward_read(ctx: StepContext) -> list[int]:
    return ctx.tree.handles(
        lambda n: (
            n.on_device and n.layers_stored > 0 and (not n.loading or n.producer_id is not None)
        )
    )


def _rule_forward_read(ctx: StepContext, args: Args) -> str | None:
    node = ctx.tree.node(node_arg(args))
    if node is None or node_arg(args) not in ctx.candidates("forward_read"):
        return f"node {node_arg(args)} is not readable (on device, stored, its load started)"
    return layer_in_range(ctx, args, node.layers_stored)


def forward_read(tree: TreeDriver, handle: int, layer: int, draft: bool) -> Outcome:
    """The forward reads one layer of the node: wait on the consumer slot, then check bytes."""
    node = tree.nodes[handle]
    assert node.value is not None
    consumer = node.producer_id if node.loading and node.producer_id is not None else -1
    for rank_index, rank in enumerate(tree.world.ranks):
        rank.controller.layer_done_counter.set_consumer(consumer)
        pool, _ = tree.geometry.pools(rank_index, draft)
        with tree.on_forward():
            pool.get_key_buffer(layer)  # waits until this layer landed (INV-11)
            _launch_read(tree, rank_index, node, layer, draft)
    for rank in tree.world.ranks:
        rank.controller.layer_done_counter.set_consumer(-1)
    return done(f"read layer {layer} of node {handle}")


def _launch_read(tree: TreeDriver, rank_index: int, node: Node, layer: int, draft: bool) -> None:
    """Queue a read of one layer of the node on the forward stream; it checks the bytes
    (on a GPU once the read has run: ``DeferredReads``)."""
    pool, _ = tree.geometry.pools(rank_index, draft)
    _, locs = tree.geometry.placement(rank_index, node, draft)
    buffers = pool.layer_buffers(layer)
    expected = [
        tree.bytes.device_rows(rank_index, node, draft, layer, c, tuple(buf.shape[1:]))
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
                tree.reads.defer(buf[locs], rows, where)
            else:
                tree.bytes.check_rows(buf[locs], rows, "INV-11", where)

    kernel = ForwardKernel("read", handle, layer)
    tree.world.device.launch(
        read, label=f"read n{handle} L{layer}", kind="kernel", meta={FORWARD_META: kernel}
    )


def process_forward_read(ctx: StepContext, args: Args) -> Outcome:
    return forward_read(ctx.tree, node_arg(args), int(args["layer"]), bool(args["draft"]))


def _choose_forward_read(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg] | None:
    handle = pick_candidate(ctx, "forward_read", int(drawn["pick"]))
    node = ctx.tree.nodes[handle]
    draft = bool(drawn["draft"]) and ctx.config.has_draft
    limit = min(layer_limit(ctx, draft), node.layers_stored)
    if limit <= 0:
        return None
    return {"node": handle, "layer": int(drawn["layer"]) % limit, "draft": draft}


def _oracle_forward_read(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.ForwardRead(view.node_id(node_arg(args)), int(args["layer"]), pool_arg(args))]


FORWARD_READ = RuleRecord(
    "forward_read",
    "load path",
    "the forward reads one layer of a node (waits on its producer slot)",
    _rule_forward_read,
    process_forward_read,
    candidates=_candidates_forward_read,
    draw=Draw(
        {"pick": PICK, "layer": Ints(0, 3), "draft": Bools()},
        _choose_forward_read,
        lambda s: bool(s.candidates("forward_read")),
    ),
    oracle=_oracle_forward_read,
    weight=5,
    args=NODE_LAYER_ARGS,
    walk=3.0,
)


# -- forward_read_batch -------------------------------------------------------------------------
def _rule_forward_read_batch(ctx: StepContext, args: Args) -> str | None:
    if MULTI_CONSUMER not in ctx.capabilities:
        return "set_consumer takes one producer slot here (no multi_consumer)"
    handles = parse_handles(args)
    if handles is None or len(handles) < 2 or len(set(handles)) != len(handles):
        return "a batch reads two or more distinct nodes (nodes='h1,h2,...')"
    readable = ctx.candidates("forward_read")
    for handle in handles:
        if handle not in readable:
            return f"node {handle} is not readable (on device, stored, its load started)"
    stored = min(ctx.tree.nodes[h].layers_stored for h in handles)
    return layer_in_range(ctx, args, stored)


def forward_read_batch(
    tree: TreeDriver, handles: Sequence[int], layer: int, draft: bool
) -> Outcome:
    """One forward batch reads one layer of several nodes, loaded by different
    ``start_loading`` calls: the consumer is every producer slot of the batch at once
    (capability ``multi_consumer``), and the one wait must cover each slot's layer event."""
    nodes = [tree.nodes[h] for h in handles]
    consumers = sorted({n.producer_id for n in nodes if n.loading and n.producer_id is not None})
    for rank_index, rank in enumerate(tree.world.ranks):
        counter = rank.controller.layer_done_counter
        assert isinstance(counter, MultiConsumerCounterLike), "multi_consumer was declared"
        counter.set_consumer(consumers)
        pool, _ = tree.geometry.pools(rank_index, draft)
        with tree.on_forward():
            pool.get_key_buffer(layer)  # waits until this layer landed in every slot (INV-11)
            for node in nodes:
                _launch_read(tree, rank_index, node, layer, draft)
    for rank in tree.world.ranks:
        rank.controller.layer_done_counter.set_consumer(-1)
    return done(f"read layer {layer} of nodes {list(handles)} (consumers {consumers})")


def process_forward_read_batch(ctx: StepContext, args: Args) -> Outcome:
    handles = parse_handles(args)
    assert handles is not None
    return forward_read_batch(ctx.tree, handles, int(args["layer"]), bool(args["draft"]))


def _choose_forward_read_batch(
    ctx: StepContext, drawn: Mapping[str, Any]
) -> dict[str, StepArg] | None:
    """Distinct readable nodes: one loading node per producer slot first, then drawn ones."""
    readable = ctx.candidates("forward_read")
    if len(readable) < 2:
        return None
    nodes = ctx.tree.nodes
    by_slot: dict[int, int] = {}
    for handle in readable:
        producer = nodes[handle].producer_id
        if nodes[handle].loading and producer is not None:
            by_slot.setdefault(producer, handle)
    picks = [int(p) for p in drawn["picks"]]
    chosen = list(by_slot.values())[: len(picks)]
    for pick in picks:
        handle = readable[pick % len(readable)]
        if len(chosen) < len(picks) and handle not in chosen:
            chosen.append(handle)
    if len(chosen) < 2:
        chosen = readable[:2]
    draft = bool(drawn["draft"]) and ctx.config.has_draft
    limit = min(layer_limit(ctx, draft), *(nodes[h].layers_stored for h in chosen))
    if limit <= 0:
        return None
    layer = int(drawn["layer"]) % limit
    return {"nodes": ",".join(map(str, chosen)), "layer": layer, "draft": draft}


def _oracle_forward_read_batch(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    layer, pool = int(args["layer"]), pool_arg(args)
    return [o.ForwardRead(view.node_id(h), layer, pool) for h in parse_handles(args) or ()]


FORWARD_READ_BATCH = RuleRecord(
    "forward_read_batch",
    "load path",
    "one forward batch reads one layer of several nodes of different producer slots",
    _rule_forward_read_batch,
    process_forward_read_batch,
    draw=Draw(
        {"picks": IntLists(0, 63, 2, 3), "layer": Ints(0, 3), "draft": Bools()},
        _choose_forward_read_batch,
        lambda s: MULTI_CONSUMER in s.capabilities and len(s.candidates("forward_read")) >= 2,
    ),
    oracle=_oracle_forward_read_batch,
    args=MappingProxyType({"nodes": "handles", "layer": "int", "draft": "bool"}),
)


# -- the drains ---------------------------------------------------------------------------------
DRAIN_LOAD = RuleRecord(
    "drain_load",
    "load path",
    "drain the ready prefix of the load acks",
    always,
    lambda ctx, args: ctx.tree.loading_check(),
    draw=draw_only_outside_machine(Draw({}, no_args, offered_always)),
    oracle=oracle_drains(write=False, load=True),
    weight=2,
    completion=Completion(drains=("load",)),
    walk=1.5,
)
DRAIN_ACKS = RuleRecord(
    "drain_acks",
    "acks",
    "the scheduler's per-step check: drain both ack queues",
    always,
    lambda ctx, args: ctx.tree.writing_check().then(ctx.tree.loading_check()),
    draw=draw_only_outside_machine(Draw({}, no_args, offered_always)),
    oracle=oracle_drains(write=True, load=True),
    weight=8,
    completion=Completion(drains=BOTH_QUEUES),
    walk=3.0,
)

RECORDS: tuple[RuleRecord, ...] = (
    LOAD,
    START_LOADING,
    FORWARD_READ,
    FORWARD_READ_BATCH,
    DRAIN_LOAD,
    DRAIN_ACKS,
)
