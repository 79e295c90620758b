"""The evict family: pages given back, device first, then host.

``evict_device`` (a backed-up, idle node's device pages) / ``drop`` (a node never backed up:
its stores may still be queued) -> the freed pages are poisoned on the forward stream, as
another request's KV would land there -> ``evict_host`` (a host-only node's host copy, on
every rank; ``evict_host_copies`` serves the misuse probes too).
"""

from __future__ import annotations

import torch

from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.record import (
    NODE_ARG,
    Args,
    OracleView,
    RuleRecord,
    StepContext,
    candidate_rule,
    node_arg,
    pick_draw,
)
from hicache_ref.harness.step_types import Outcome, done
from hicache_ref.harness.world.content import FREED_ROW_VALUE
from hicache_ref.oracle import ops as o


# -- evict_device -------------------------------------------------------------------------------
def _candidates_evict_device(ctx: StepContext) -> list[int]:
    return ctx.tree.handles(
        lambda n: n.on_device and n.backup == "done" and not n.loading and n.pending_reads == 0
    )


def evict_device(tree: TreeDriver, handle: int) -> Outcome:
    node = tree.nodes[handle]
    assert node.value is not None
    for controller in tree.controllers():
        controller.evict_device(node.value)
    _poison_freed_pages(tree, node)
    _free_side_rows(tree, node)
    node.value, node.placement_of = None, None
    return done(f"evict_device node {handle}")


def _free_side_rows(tree: TreeDriver, node: Node) -> None:
    """An independent side pool's rows go back to its own allocator (``free_swa_segment``)."""
    allocator = tree.world.ranks[0].side_allocator
    if allocator is not None and node.side_value is not None:
        allocator.free(node.side_value)
        node.side_value = None


def _poison_freed_pages(tree: TreeDriver, node: Node) -> None:
    """What reuse does to freed pages: another request's KV lands there. The forward stream
    fills them with poison, so a load whose read runs before its copy cannot pass by
    finding the bytes the same node left behind (a reload often gets its old pages back)."""
    assert node.value is not None
    if tree.config.has_side_pools:  # each pool's own rows
        for rank in range(len(tree.world.ranks)):
            for draft, layer_num in tree.geometry.layer_kinds():
                _poison_rows(tree, node, rank, draft, layer_num)
        return
    geometry = tree.geometry
    for rank in range(len(tree.world.ranks)):
        _, locs = geometry.placement(rank, node)
        buffers = [
            buf
            for draft, layer_num in geometry.layer_kinds()
            for layer in range(layer_num)
            for buf in geometry.pools(rank, draft)[0].layer_buffers(layer)
        ]
        pools = [("draft" if d else "target", n) for d, n in geometry.layer_kinds()]
        _launch_poison(tree, node, rank, buffers, locs, pools)


def _poison_rows(tree: TreeDriver, node: Node, rank: int, draft: bool, layer_num: int) -> None:
    """The poison of one pool's rows of the node (an independent side pool's are its own)."""
    _, locs = tree.geometry.placement(rank, node, draft)
    pool = tree.geometry.pools(rank, draft)[0]
    buffers = [buf for layer in range(layer_num) for buf in pool.layer_buffers(layer)]
    _launch_poison(tree, node, rank, buffers, locs, [("draft" if draft else "target", layer_num)])


def _launch_poison(
    tree: TreeDriver,
    node: Node,
    rank: int,
    buffers: list[torch.Tensor],
    locs: torch.Tensor,
    pools: list[tuple[str, int]],
) -> None:
    """Queue the poison of ``locs`` in ``buffers`` on the forward stream."""
    stores = tree.stores

    def poison() -> None:
        for buf in buffers:
            # index_fill_, not ``buf[locs] = value``: a Python scalar assigned through an
            # index is uploaded first, and that pageable upload makes the host wait for
            # the forward stream (measured on an H200: 101 ms behind a 100 ms spin;
            # benchmarks/host_waits.py), draining the stores a load must race
            buf.index_fill_(0, locs, FREED_ROW_VALUE)
        if stores.active:  # the simulator only: never a host sync on a GPU
            stores.poisoned(rank, pools, locs.tolist())

    with tree.on_forward():
        tree.world.device.launch(poison, label=f"reuse n{node.handle}", kind="kernel")


def process_evict_device(ctx: StepContext, args: Args) -> Outcome:
    return evict_device(ctx.tree, node_arg(args))


def _oracle_evict_device(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.EvictDevice(view.node_id(node_arg(args)))]


EVICT_DEVICE = RuleRecord(
    "evict_device",
    "eviction",
    "free a backed-up node's device pages",
    candidate_rule("evict_device", "backed up, on device, idle"),
    process_evict_device,
    candidates=_candidates_evict_device,
    draw=pick_draw("evict_device"),
    oracle=_oracle_evict_device,
    weight=3,
    args=NODE_ARG,
    walk=3.0,
)


# -- drop ---------------------------------------------------------------------------------------
def _candidates_drop(ctx: StepContext) -> list[int]:
    return ctx.tree.handles(lambda n: n.on_device and n.backup == "none" and not n.loading)


def drop(tree: TreeDriver, handle: int) -> Outcome:
    """Free a node that was never backed up (its stores may still be queued: overlap)."""
    node = tree.nodes.pop(handle)
    assert node.value is not None and node.backup == "none"
    tree.leave_batch(handle)  # an aborted request leaves the forward batch
    for controller in tree.controllers():
        controller.evict_device(node.value)
    _poison_freed_pages(tree, node)
    _free_side_rows(tree, node)
    return done(f"drop node {handle}")


def process_drop(ctx: StepContext, args: Args) -> Outcome:
    return drop(ctx.tree, node_arg(args))


DROP = RuleRecord(
    "drop",
    "eviction",
    "free a node never backed up",
    candidate_rule("drop", "on device, not backed up, not loading"),
    process_drop,
    candidates=_candidates_drop,
    draw=pick_draw("drop"),
    oracle=_oracle_evict_device,  # the oracle frees a node's device pages either way
    weight=2,
    args=NODE_ARG,
)


# -- evict_host ---------------------------------------------------------------------------------
def _candidates_evict_host(ctx: StepContext) -> list[int]:
    return ctx.tree.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)


def evict_host(tree: TreeDriver, handle: int) -> Outcome:
    node = tree.nodes.pop(handle)
    tree.leave_batch(handle)
    evict_host_copies(tree, node, tuple(range(len(tree.world.ranks))))
    return done(f"evict_host node {handle}")


def evict_host_copies(tree: TreeDriver, node: Node, ranks: tuple[int, ...]) -> None:
    """Free the node's host copy on ``ranks`` (its CP reservation, or its host indices)."""
    for rank_index in ranks:
        if tree.config.uses_cp:
            tree.cp_controllers()[rank_index].evict_cp_host(tree.geometry.meta(node, rank_index))
        else:
            host = node.host_value[rank_index]
            assert host is not None
            rank = tree.world.ranks[rank_index]
            rank.controller.evict_host(host)
            side_host = node.side_host[rank_index] if node.side_host else None
            if rank.sides is not None and side_host is not None:
                rank.sides.evict_host(side_host)  # the side pool's own slots


def process_evict_host(ctx: StepContext, args: Args) -> Outcome:
    return evict_host(ctx.tree, node_arg(args))


EVICT_HOST = RuleRecord(
    "evict_host",
    "eviction",
    "free a host-only node's host copy",
    candidate_rule("evict_host", "host only and not loading"),
    process_evict_host,
    candidates=_candidates_evict_host,
    draw=pick_draw("evict_host"),
    oracle=lambda view, args, outcome: [o.EvictHost(view.node_id(node_arg(args)))],
    weight=2,
    args=NODE_ARG,
    walk=3.0,
)

RECORDS: tuple[RuleRecord, ...] = (EVICT_DEVICE, DROP, EVICT_HOST)
