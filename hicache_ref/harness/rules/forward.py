"""The forward family: a request's prefill, then its KV stored layer by layer.

``prefill`` (new pages; with ``early_reserve`` an early CP reservation) -> ``forward_layer``
(one layer of the forward batch: every node's store, then the pools' layer hooks) ->
``store_layer`` / ``layer_end`` (the same, one node and one hook at a time: oracle traces).
Every store runs on the forward's stream, so a D2H that does not wait for it reads stale rows.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import torch

from hicache_ref.harness.driver.node_model import FORWARD_META, ForwardKernel, Node
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.record import (
    LAYER_ARGS,
    NODE_LAYER_ARGS,
    Args,
    Draw,
    OracleView,
    RuleRecord,
    StepContext,
    draw_only_outside_machine,
    layer_in_range,
    needs_per_layer_write,
    no_args,
    node_arg,
    pool_arg,
)
from hicache_ref.harness.rules.write import reserve_cp
from hicache_ref.harness.step_types import Outcome, StepArg, done, refused
from hicache_ref.invariants.evidence import RankValues
from hicache_ref.oracle import ops as o


# -- prefill ------------------------------------------------------------------------------------
def _rule_prefill(ctx: StepContext, args: Args) -> str | None:
    if int(args.get("tokens", 0)) < 1:
        return "a prefill needs tokens >= 1"
    handle = int(args.get("handle", ctx.tree.next_handle))
    if handle in ctx.tree.nodes:
        return f"handle {handle} is taken"
    return None


def prefill(
    tree: TreeDriver,
    num_tokens: int,
    early_reserve: bool,
    handle: int | None = None,
    batch: bool = True,
) -> Outcome:
    """Allocate a new node's pages; its KV is stored layer by layer by ``forward_layer``."""
    config, world = tree.config, tree.world
    handle = tree.next_handle if handle is None else handle
    tree.next_handle = max(tree.next_handle, handle) + 1  # consumed even when refused
    page = config.page_size
    logical_len = num_tokens if config.uses_cp else -(-num_tokens // page) * page
    padded_len = -(-logical_len // page) * page
    if tree.batch_layer > 0:
        return refused("a forward batch is mid-way (it finishes first)")
    allocs = [rank.allocator.alloc(padded_len) for rank in world.ranks]
    if any(a is None for a in allocs):
        for a, rank in zip(allocs, world.ranks, strict=True):
            if a is not None:
                rank.allocator.free(a)
        return refused("device full")
    side = _alloc_side_rows(tree, padded_len)
    if side is False:
        for a, rank in zip(allocs, world.ranks, strict=True):
            assert a is not None
            rank.allocator.free(a)
        return refused("side pool device full")
    first = allocs[0]
    assert first is not None
    if len(allocs) > 1:
        pages = [[a.tolist() if a is not None else []] for a in allocs]
        values = RankValues("the allocators' logical pages", pages, ack_rows=False)
        tree.checks.run("INV-14", values)
    node = Node(
        handle=handle,
        node_id=tree.next_node_id,
        logical_len=logical_len,
        value=first[:logical_len].clone(),
    )
    tree.next_node_id += 1
    if isinstance(side, torch.Tensor):
        node.side_value = side[: config.side_rows(logical_len)].clone()
        node.side_host = [None] * len(world.ranks)
    node.host_value = [None] * len(world.ranks)
    node.cp_meta = [None] * len(world.ranks)
    tree.nodes[handle] = node
    if batch:  # else the node's layers are stored one by one with store_layer
        tree.batch.append(handle)
    text = f"node {handle} ({logical_len} tokens)"
    if early_reserve and config.uses_cp and world.per_layer_write:
        early = reserve_cp(tree, node, catch_up=False)
        return Outcome(
            f"{text}; {early.text}",
            reservation="refused" if early.refused else "made",
            agreed=f"{text}; {early.shared}",
        )
    return done(text)


def _alloc_side_rows(tree: TreeDriver, padded_len: int) -> torch.Tensor | bool:
    """A new node's rows in an independent side pool, from its own allocator (what the SWA
    allocator hands a request beside its KV); True: no side pool, False: it is full."""
    allocator = tree.world.ranks[0].side_allocator
    if allocator is None:
        return True
    rows = allocator.alloc(tree.config.side_rows(padded_len))  # a state pool: one slot
    return False if rows is None else rows


def process_prefill(ctx: StepContext, args: Args) -> Outcome:
    return prefill(
        ctx.tree,
        int(args["tokens"]),
        bool(args.get("early_reserve", False)),
        int(args["handle"]),
        batch=bool(args.get("batch", True)),
    )


def _pin_prefill(ctx: StepContext, args: Args) -> Args:
    """Name the node in the step itself, so deleting earlier steps (ddmin) keeps every later
    reference to it valid."""
    return args if "handle" in args else {**args, "handle": ctx.tree.next_handle}


def _oracle_prefill(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [] if outcome.refused else view.prefill_ops(int(args["handle"]), outcome)


def _sample_prefill(ctx: StepContext, rng: random.Random) -> dict[str, StepArg] | None:
    """A walk's prefill: up to three pages, an early reservation now and then (CP)."""
    page = ctx.config.page_size
    early = ctx.config.uses_cp and ctx.world.per_layer_write and rng.random() < 0.4
    return {"tokens": rng.randint(1, 3 * page), "early_reserve": early, "batch": True}


def _requires_prefill(ctx: StepContext, args: Args) -> frozenset[str]:
    """Without ``per_layer_write`` the tree reserves nothing early."""
    early = bool(args.get("early_reserve")) and ctx.config.uses_cp
    return frozenset({"per_layer_write"}) if early else frozenset()


PREFILL = RuleRecord(
    "prefill",
    "forward",
    "a request's prefill: new pages (the forward stores them layer by layer)",
    _rule_prefill,
    process_prefill,
    oracle=_oracle_prefill,
    pins=_pin_prefill,
    refusable=True,
    args=MappingProxyType(
        {"tokens": "int", "handle": "int", "early_reserve": "bool", "batch": "bool"}
    ),
    walk=3.0,
    sample=_sample_prefill,
    returns="new_node",
    requires=_requires_prefill,
)


# -- forward_layer ------------------------------------------------------------------------------
def forward_layer(tree: TreeDriver) -> Outcome:
    """One layer of the forward batch: queue every batch node's KV store, then the hooks.

    All nodes prefilled together form one batch (a forward pass computes them together),
    so a layer-end hook fires only after that layer was stored for every pending node.
    """
    batch = [tree.nodes[h] for h in tree.batch]
    layer = tree.batch_layer
    assert batch and layer < tree.total_layers
    for draft, layer_num in tree.geometry.layer_kinds():
        if layer >= layer_num:
            continue
        with tree.on_forward():
            for node in batch:
                if node.value is None:
                    continue
                for rank in range(len(tree.world.ranks)):
                    _enqueue_store(tree, rank, node, draft, layer)
            for rank in range(len(tree.world.ranks)):
                pool, _ = tree.geometry.pools(rank, draft)
                pool.notify_layer_end(layer)
    for node in batch:
        node.layers_stored = layer + 1
    tree.batch_layer += 1
    if tree.batch_layer == tree.total_layers:
        tree.batch, tree.batch_layer = [], 0
    return done(f"stored layer {layer} of nodes {[n.handle for n in batch]}")


def _enqueue_store(tree: TreeDriver, rank: int, node: Node, draft: bool, layer: int) -> None:
    assert node.value is not None
    pool, _ = tree.geometry.pools(rank, draft)
    _, locs = tree.geometry.placement(rank, node, draft)
    buffers = pool.layer_buffers(layer)
    payload = [
        tree.bytes.staged_rows(rank, node, (draft, layer, c), buf) for c, buf in enumerate(buffers)
    ]  # on the buffers' device before the launch: the store itself never syncs the host

    stores, pool_name = tree.stores, "draft" if draft else "target"
    rows_at = locs.tolist() if stores.active else []  # never a host sync on a GPU

    def store() -> None:
        for buf, rows in zip(buffers, payload, strict=True):
            buf[locs] = rows
        stores.stored(rank, pool_name, layer, rows_at)

    kernel = ForwardKernel("store", node.handle, layer)
    tree.world.device.launch(
        store,
        label=f"store n{node.handle} L{layer}",
        kind="kernel",
        meta={FORWARD_META: kernel},
    )


def _rule_forward_layer(ctx: StepContext, args: Args) -> str | None:
    return None if ctx.tree.batch else "no forward batch is being computed"


def _offered_batch(ctx: StepContext) -> bool:
    return bool(ctx.tree.batch)


FORWARD_LAYER = RuleRecord(
    "forward_layer",
    "forward",
    "one layer of the forward batch: every node's store, then the layer hooks",
    _rule_forward_layer,
    lambda ctx, args: forward_layer(ctx.tree),
    draw=draw_only_outside_machine(Draw({}, no_args, _offered_batch)),
    oracle=lambda view, args, outcome: view.forward_layer_ops(),
    weight=8,
    walk=5.0,
)


# -- store_layer --------------------------------------------------------------------------------
def store_layer(tree: TreeDriver, handle: int, layer: int, draft: bool) -> Outcome:
    """Queue one layer's KV store of one node (fine-grained; oracle traces use it)."""
    node = tree.nodes[handle]
    with tree.on_forward():
        for rank in range(len(tree.world.ranks)):
            _enqueue_store(tree, rank, node, draft, layer)
    if not draft or tree.config.draft_layer_num >= tree.config.layer_num:
        node.layers_stored = max(node.layers_stored, layer + 1)
    return done(f"stored {'draft' if draft else 'target'} layer {layer} of node {handle}")


def _rule_store_layer(ctx: StepContext, args: Args) -> str | None:
    node = ctx.tree.node(node_arg(args))
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if node.loading:
        return f"node {node_arg(args)} is loading"
    return layer_in_range(ctx, args)


def process_store_layer(ctx: StepContext, args: Args) -> Outcome:
    return store_layer(ctx.tree, node_arg(args), int(args["layer"]), bool(args["draft"]))


def _oracle_store_layer(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.Store(view.node_id(node_arg(args)), int(args["layer"]), pool_arg(args))]


STORE_LAYER = RuleRecord(
    "store_layer",
    "forward",
    "one layer's KV store of one node (oracle traces)",
    _rule_store_layer,
    process_store_layer,
    oracle=_oracle_store_layer,
    args=NODE_LAYER_ARGS,
    walk=0.0,  # a store after the node's backup is no program a radix tree runs
)


# -- layer_end ----------------------------------------------------------------------------------
def layer_end(tree: TreeDriver, layer: int, draft: bool) -> Outcome:
    """The device pools' layer-end hooks for ``layer`` (drives pending per-layer writes)."""
    with tree.on_forward():
        for rank in range(len(tree.world.ranks)):
            pool, _ = tree.geometry.pools(rank, draft)
            pool.notify_layer_end(layer)
    return done(f"layer_end {layer} ({'draft' if draft else 'target'})")


def _rule_layer_end(ctx: StepContext, args: Args) -> str | None:
    return needs_per_layer_write(ctx) or layer_in_range(ctx, args)


LAYER_END = RuleRecord(
    "layer_end",
    "forward",
    "the pools' layer-end hooks (drive pending per-layer writes)",
    _rule_layer_end,
    lambda ctx, args: layer_end(ctx.tree, int(args["layer"]), bool(args["draft"])),
    oracle=lambda view, args, outcome: [o.OnLayerEnd(int(args["layer"]), pool_arg(args))],
    args=LAYER_ARGS,
    walk=0.0,  # oracle traces only
)

RECORDS: tuple[RuleRecord, ...] = (PREFILL, FORWARD_LAYER, STORE_LAYER, LAYER_END)
