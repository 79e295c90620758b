"""Tree-side transitions that are not transfers: insert, store, evict_device, evict_host, reset.

The radix tree decides *when* the controller may be called; these steps apply what the tree
does between controller calls. The frees go through ``slots`` so the INV-05/07/08 guards run.
"""

from __future__ import annotations

from hicache_ref.oracle.config import FORWARD
from hicache_ref.oracle.geometry import alloc_balanced, compute_channel, set_holders
from hicache_ref.oracle.ops import Insert, Store
from hicache_ref.oracle.slots import check_device_pages, free_device_pages, free_host_pages
from hicache_ref.oracle.state import (
    Lifecycle,
    NodeState,
    Observation,
    OracleState,
    StoreKv,
    evolve,
    initial_state,
    with_node,
)
from hicache_ref.oracle.streams import enqueue, synchronize_all
from hicache_ref.oracle.write_path import Step


def size_node(state: OracleState, node: int, tokens: int) -> OracleState:
    """``state`` whose universe holds node ``node`` with ``tokens`` tokens (grown or re-sized)."""
    config = state.config.with_node_tokens(node, tokens)
    nodes = state.nodes if node < len(state.nodes) else (*state.nodes, NodeState())
    return evolve(state, config=config, nodes=nodes)


def process_insert(state: OracleState, op: Insert) -> Step:
    """Prefill: allocate the node's device pages; a full device pool is a shortfall value."""
    if op.tokens is not None:
        state = size_node(state, op.node, op.tokens)
    config = state.config
    count = config.node_pages(op.node)
    if op.device_pages is not None:
        check_device_pages(state, op.device_pages, count)
        pages: tuple[int, ...] | None = op.device_pages
    else:
        classes = tuple(config.page_owner(p) for p in range(config.device_pages))
        pages = alloc_balanced(state.device_holders, classes, count)
    if pages is None:
        return state, (Observation("insert_failure", op.node, reason="device_capacity"),)
    holders = set_holders(state.device_holders, pages, op.node)
    state = evolve(state, device_holders=holders)
    inserted = NodeState(lifecycle="device_only", device_pages=pages)
    return with_node(state, op.node, inserted), (Observation("insert", op.node, pages=(pages,)),)


def process_store(state: OracleState, op: Store) -> Step:
    """The forward queues the node's KV store of one layer of one pool."""
    config = state.config
    record = state.nodes[op.node]
    channel = compute_channel(config.layer_num, op.pool == "draft", op.layer)
    streams = enqueue(state.streams, FORWARD, StoreKv(op.node, channel, record.device_pages))
    issued = tuple(sorted({*record.stores_issued, channel}))
    state = evolve(state, streams=streams)
    return with_node(state, op.node, evolve(record, stores_issued=issued)), ()


def process_evict_device(state: OracleState, node: int) -> Step:
    """``evict_device``: free the device pages; a node without a host copy is deleted."""
    record = state.nodes[node]
    state = free_device_pages(state, node)
    lifecycle: Lifecycle = "gone" if record.lifecycle == "device_only" else "host_only"
    evicted = evolve(
        record, lifecycle=lifecycle, device_pages=(), stores_issued=(), reads_issued=()
    )
    return with_node(state, node, evicted), (Observation("evict_device", node),)


def process_evict_host(state: OracleState, node: int) -> Step:
    """``evict_host``/``evict_cp_host``: free target and draft host pages, delete the node."""
    record = state.nodes[node]
    state = free_host_pages(state, node)
    if record.lifecycle == "host_only":
        evicted = NodeState(lifecycle="gone")
    else:
        # Only reachable with the free_host_before_write_ack planted bug
        evicted = evolve(
            record, lifecycle="device_only", host_pages=(), draft_host_pages=(), page_owners=()
        )
    return with_node(state, node, evicted), (Observation("evict_host", node),)


def process_reset(state: OracleState) -> Step:
    """``reset()`` once the device is idle: every pool, queue, ack and counter starts over."""
    state, observations = synchronize_all(state)
    fresh = evolve(initial_state(state.config), faults=state.faults)
    if state.config.variant.reset_keeps_acks:
        fresh = evolve(fresh, write_acks=state.write_acks, load_acks=state.load_acks)
    return fresh, (*observations, Observation("reset"))
