"""Load side of the protocol: load -> start_loading -> per-layer events -> load ack -> loading_check.

``process_load`` allocates device pages whose owners replay the node's ``page_owners`` (INV-03),
pins the node and queues it. ``process_start_loading`` takes the next producer slot of the
``LayerDoneCounter`` (refusing a busy one is the tree's job, INV-10), records the start event on
the forward stream and queues, per layer, the draft and target H2D followed by that layer's
event; the finish event is recorded after the last copy (INV-04). A forward read waits on its
layer's event of the node's producer slot before reading (INV-11).
"""

from __future__ import annotations

from hicache_ref.oracle.config import FORWARD, LOAD
from hicache_ref.oracle.geometry import (
    alloc_balanced,
    alloc_with_owners,
    compute_channel,
    compute_drainable_prefix,
    compute_next_producer,
    set_holders,
)
from hicache_ref.oracle.ops import ForwardRead, Load
from hicache_ref.oracle.slots import check_device_pages
from hicache_ref.oracle.state import (
    Ack,
    CopyPages,
    Observation,
    OracleState,
    PagePair,
    ReadKv,
    evolve,
    with_fault,
    with_node,
)
from hicache_ref.oracle.streams import enqueue, enqueue_record, enqueue_wait, is_event_complete
from hicache_ref.oracle.write_path import Step, check_drained_ack, compute_backup_pairs

__all__ = [
    "process_drain_load_acks",
    "process_forward_read",
    "process_load",
    "process_start_loading",
]


def process_load(state: OracleState, op: Load) -> Step:
    """``load``/``load_cp``: allocate pages with the recorded owners, pin, queue on every rank."""
    config = state.config
    record = state.nodes[op.node]
    owners = record.page_owners
    classes = tuple(config.page_owner(p) for p in range(config.device_pages))
    if op.device_pages is not None:
        check_device_pages(state, op.device_pages, len(owners))
        pages: tuple[int, ...] | None = op.device_pages
    elif config.variant.skip_owner_replay:
        pages = alloc_balanced(state.device_holders, classes, len(owners))
    else:
        pages = alloc_with_owners(state.device_holders, classes, owners)
    if pages is None:
        return state, (Observation("load_failure", op.node, reason="device_capacity"),)
    holders = set_holders(state.device_holders, pages, op.node)
    queue = tuple(
        q if config.variant.zero_owned_rank_drops_load and rank not in owners else (*q, op.node)
        for rank, q in enumerate(state.load_queue)
    )
    pinned = evolve(
        record,
        lifecycle="load_queued",
        device_pages=pages,
        stores_issued=(),
        reads_issued=(),
        lock_ref=record.lock_ref + 1,
    )
    state = evolve(state, device_holders=holders, load_queue=queue)
    return with_node(state, op.node, pinned), (Observation("load", op.node, pages=(pages,)),)


def _load_pairs(state: OracleState, nodes: tuple[int, ...], channel: int) -> tuple[PagePair, ...]:
    draft = channel >= state.config.layer_num
    pairs: list[PagePair] = []
    for node in nodes:
        record = state.nodes[node]
        host = record.draft_host_pages if draft else record.host_pages
        # A rank that dropped the node from its queue copies nothing for it
        host = tuple(
            pages if node in state.load_queue[rank] else () for rank, pages in enumerate(host)
        )
        owners = tuple(o if node in state.load_queue[o] else -1 for o in record.page_owners)
        pairs.extend(compute_backup_pairs(owners, record.device_pages, host))
    return tuple(pairs)


def process_start_loading(state: OracleState) -> Step:
    """``start_loading``: producer slot, start event, per-layer H2D + events, finish, acks."""
    config = state.config
    nodes = tuple(dict.fromkeys(n for queue in state.load_queue for n in queue))
    if not nodes:
        return state, (Observation("start_loading", values=(-1,)),)
    slot = compute_next_producer(state.producer_index, config.num_counters)
    # Verify the producer slot is not reused while its last load is pending (INV-10, bug class 7)
    busy = any(ack.slot == slot for queue in state.load_acks for ack in queue)
    if busy or not is_event_complete(state.streams, ("lfin", slot, -1)):
        state = with_fault(
            state,
            "INV-10",
            f"update_producer reused producer slot {slot} while its previous load is undrained "
            f"(keep undrained load acks < num_counters={config.num_counters})",
        )
    streams = enqueue_record(state.streams, FORWARD, ("lstart", slot, -1))
    streams = enqueue_wait(streams, LOAD, ("lstart", slot, -1))
    last = config.total_layers - 1
    for layer in range(config.total_layers):
        if config.variant.load_ack_before_last_layer and layer == last:
            streams = enqueue_record(streams, LOAD, ("lfin", slot, -1))
        if layer < config.draft_layer_num:
            channel = compute_channel(config.layer_num, True, layer)
            copy = CopyPages("h2d", channel, nodes, _load_pairs(state, nodes, channel))
            streams = enqueue(streams, LOAD, copy)
            if config.harness_schedule:  # the controller's draft layer event (complete_draft)
                streams = enqueue_record(streams, LOAD, ("ldraft", slot, layer))
        if layer < config.layer_num:
            copy = CopyPages("h2d", layer, nodes, _load_pairs(state, nodes, layer))
            streams = enqueue(streams, LOAD, copy)
        streams = enqueue_record(streams, LOAD, ("lload", slot, layer))
    if not config.variant.load_ack_before_last_layer:
        streams = enqueue_record(streams, LOAD, ("lfin", slot, -1))
    acks = tuple(
        (*acked, Ack(queue, ("lfin", slot, -1), slot)) if queue else acked
        for acked, queue in zip(state.load_acks, state.load_queue, strict=True)
    )
    state = evolve(
        state,
        streams=streams,
        load_acks=acks,
        load_queue=((),) * config.num_ranks,
        producer_index=slot,
    )
    for node in nodes:
        record = state.nodes[node]
        state = with_node(state, node, evolve(record, lifecycle="load_in_flight", load_slot=slot))
    return state, (Observation("start_loading", values=(slot,)),)


def process_drain_load_acks(state: OracleState, tree_count: int | None = None) -> Step:
    """``loading_check``: pop the FIFO prefix of completed load acks and unpin their nodes.

    ``tree_count``: as for ``process_drain_write_acks``.
    """
    streams = state.streams
    if tree_count is not None:
        count = min(tree_count, *(len(queue) for queue in state.load_acks))
    elif state.config.variant.drain_ignores_finish:
        count = min(len(queue) for queue in state.load_acks)
    else:
        count = min(
            compute_drainable_prefix(tuple(is_event_complete(streams, a.finish) for a in queue))
            for queue in state.load_acks
        )
    if count == 0:
        return state, ()
    drained = state.load_acks[0][:count]
    for ack in drained:
        state = check_drained_ack(state, ack, "h2d")
    state = evolve(state, load_acks=tuple(queue[count:] for queue in state.load_acks))
    released: list[int] = []
    for ack in drained:
        for node in ack.node_ids:
            released.append(node)
            record = state.nodes[node]
            # Verify the ack releases a load in flight (INV-09)
            if record.lifecycle != "load_in_flight":
                state = with_fault(
                    state,
                    "INV-09",
                    f"load ack for node {node} drained but the node has no load in flight "
                    f"(lifecycle {record.lifecycle})",
                )
                continue
            loaded = evolve(record, lifecycle="loaded", lock_ref=record.lock_ref - 1)
            state = with_node(state, node, loaded)
    return state, (Observation("drained_load", values=tuple(released)),)


def process_forward_read(state: OracleState, op: ForwardRead) -> Step:
    """``get_key_buffer(layer)``: ``wait_until(layer)`` on the consumer slot, then the read."""
    config = state.config
    record = state.nodes[op.node]
    channel = compute_channel(config.layer_num, op.pool == "draft", op.layer)
    streams = state.streams
    # The harness's forward gates on the producer slot only while the node is loading
    gated = not config.harness_schedule or record.lifecycle == "load_in_flight"
    # a draft read waits on the draft layer's own event where the controller records one
    kind = "ldraft" if config.harness_schedule and op.pool == "draft" else "lload"
    if not config.variant.skip_layer_gate and gated:
        streams = enqueue_wait(streams, FORWARD, (kind, record.load_slot, op.layer))
    streams = enqueue(streams, FORWARD, ReadKv(op.node, channel, record.device_pages))
    reads = (*record.reads_issued, channel)
    state = with_node(state, op.node, evolve(record, reads_issued=reads))
    return evolve(state, streams=streams), ()
