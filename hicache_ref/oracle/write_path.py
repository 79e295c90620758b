"""Write side of the protocol: write -> (per-layer submits) -> write ack -> writing_check.

``process_write`` is the all-layer path (``write`` / ``_write_cp``): reserve host slots, record a
fence on the forward stream, queue a D2H per channel behind it, then the finish record and one
ack per rank. ``process_reserve_write_cp`` + ``submit_layer_states`` is the CP per-layer path:
each submitted layer records a layer event on the forward stream, the write stream waits on the
write's start event and that layer event, and the ack is appended once every target *and* draft
layer was submitted (INV-04).
"""

from __future__ import annotations

from hicache_ref.oracle.config import FORWARD, WRITE, OracleConfig
from hicache_ref.oracle.geometry import (
    compute_drainable_prefix,
    compute_owned_positions,
    reserved_holder,
    set_holders,
)
from hicache_ref.oracle.ops import ReserveWriteCp, Write
from hicache_ref.oracle.slots import (
    RankPages,
    assign_host_pages,
    choose_host_pages,
    compute_host_demand,
    free_host_pages,
)
from hicache_ref.oracle.state import (
    Ack,
    CopyPages,
    LayerWriteState,
    Observation,
    OracleState,
    PagePair,
    evolve,
    replace_at,
    with_fault,
    with_node,
)
from hicache_ref.oracle.streams import (
    enqueue,
    enqueue_record,
    enqueue_wait,
    has_pending_copy,
    is_event_complete,
    synchronize_stream,
)

Step = tuple[OracleState, tuple[Observation, ...]]


def compute_backup_pairs(
    owners: tuple[int, ...], device_pages: tuple[int, ...], host_pages: RankPages
) -> tuple[PagePair, ...]:
    """Page pairs of a node's copy: rank ``r``'s k-th host page <-> its k-th owned device page.

    pre: len(owners) == len(device_pages)
    pre: all(len(host_pages[r]) == owners.count(r) for r in range(len(host_pages)))
    post: len(__return__) == sum(len(p) for p in host_pages)
    post: all(owners[device_pages.index(d)] == r for r, _, d in __return__) or len(set(device_pages)) < len(device_pages)
    """
    pairs: list[PagePair] = []
    for rank, pages in enumerate(host_pages):
        positions = compute_owned_positions(owners, rank)
        pairs.extend(
            (rank, host, device_pages[pos]) for host, pos in zip(pages, positions, strict=True)
        )
    return tuple(pairs)


def node_has_undrained_write_ack(state: OracleState, node: int) -> bool:
    """Whether any rank's ``ack_write_queue`` still names ``node`` (the INV-02 gate, by scan)."""
    return any(node in ack.node_ids for queue in state.write_acks for ack in queue)


def is_layer_write_done(
    layer_num: int, draft_layer_num: int, target_done: tuple[int, ...], draft_done: tuple[int, ...]
) -> bool:
    """Every target layer and every draft layer of a per-layer write was submitted (INV-04).

    pre: layer_num >= 1 and draft_layer_num >= 0
    pre: all(0 <= layer < layer_num for layer in target_done)
    pre: all(0 <= layer < draft_layer_num for layer in draft_done)
    post: __return__ == (set(target_done) == set(range(layer_num)) and set(draft_done) == set(range(draft_layer_num)))
    """
    return len(set(target_done)) == layer_num and len(set(draft_done)) == draft_layer_num


def _step_thinks_done(config: OracleConfig, pending: LayerWriteState) -> bool:
    if config.variant.skip_draft_layers:
        return len(set(pending.target_done)) == config.layer_num
    return is_layer_write_done(
        config.layer_num, config.draft_layer_num, pending.target_done, pending.draft_done
    )


def _reserve(
    state: OracleState,
    node: int,
    explicit: RankPages | None,
    explicit_draft: RankPages | None,
) -> tuple[OracleState, RankPages, RankPages] | Observation:
    """Reserve target (and draft) host pages for ``node``'s owned pages, or report a shortfall."""
    config = state.config
    record = state.nodes[node]
    owners = tuple(config.page_owner(p) for p in record.device_pages)
    demand = compute_host_demand(owners, config.num_ranks)
    if node in state.cancelled:  # backed up again (harness_schedule): a new write, not the old
        state = evolve(state, cancelled=tuple(n for n in state.cancelled if n != node))
    target = choose_host_pages(state.host_holders[0], demand, explicit)
    draft: RankPages | None = ()
    if config.has_draft:
        draft = choose_host_pages(state.host_holders[1], demand, explicit_draft)
    if target is None:
        return Observation("write_failure", node, reason="host_capacity")
    if draft is None:
        return Observation("write_failure", node, reason="draft_host_capacity")
    state = assign_host_pages(state, 0, target, reserved_holder(node))
    if config.has_draft:
        state = assign_host_pages(state, 1, draft, reserved_holder(node))
    updated = evolve(
        record,
        lifecycle="backup_in_flight",
        host_pages=target,
        draft_host_pages=draft,
        page_owners=owners,
        backup_channels=(),
        lock_ref=record.lock_ref + 1,
    )
    return with_node(state, node, updated), target, draft


def _result(node: int, target: RankPages, draft: RankPages) -> tuple[Observation, ...]:
    return (Observation("write", node, pages=target), Observation("write_draft", node, pages=draft))


def _pairs_for(state: OracleState, node: int, channel: int) -> tuple[PagePair, ...]:
    record = state.nodes[node]
    draft = channel >= state.config.layer_num
    host = record.draft_host_pages if draft else record.host_pages
    return compute_backup_pairs(record.page_owners, record.device_pages, host)


def _append_write_ack(state: OracleState, node: int, times: int) -> OracleState:
    ack = Ack((node,), ("wfin", node, -1))
    acks = tuple(queue + (ack,) * times for queue in state.write_acks)
    return evolve(state, write_acks=acks)


def process_write(state: OracleState, op: Write) -> Step:
    """``write``: reserve host pages, fence, D2H of every channel, finish record, ack."""
    config = state.config
    # Verify a CP write (``_write_cp`` -> ``reserve_write_cp``) is not a second ack (INV-02)
    if config.uses_cp and node_has_undrained_write_ack(state, op.node):
        return state, (Observation("write_failure", op.node, reason="undrained_ack"),)
    reserved = _reserve(state, op.node, op.host_pages, op.draft_host_pages)
    if isinstance(reserved, Observation):
        return state, (reserved,)
    state, target, draft = reserved
    node = op.node
    streams = enqueue_record(state.streams, FORWARD, ("fence", node, -1))
    if not config.variant.no_fence_before_d2h:
        streams = enqueue_wait(streams, WRITE, ("fence", node, -1))
    state = evolve(state, streams=streams)
    copies = tuple(
        CopyPages("d2h", channel, (node,), _pairs_for(state, node, channel))
        for channel in range(config.num_channels)
    )
    streams = enqueue(state.streams, WRITE, *copies)
    streams = enqueue_record(streams, WRITE, ("wfin", node, -1))
    record = state.nodes[node]
    state = with_node(
        evolve(state, streams=streams),
        node,
        evolve(record, backup_channels=tuple(range(config.num_channels))),
    )
    state = _append_write_ack(state, node, 2 if config.variant.duplicate_write_ack else 1)
    return state, _result(node, target, draft)


def process_reserve_write_cp(state: OracleState, op: ReserveWriteCp) -> Step:
    """``reserve_write_cp``: refuse on an undrained ack (INV-02), else reserve and register."""
    # Verify the node has no undrained write ack before a second reservation (INV-02)
    if node_has_undrained_write_ack(state, op.node):
        return state, (Observation("write_failure", op.node, reason="undrained_ack"),)
    reserved = _reserve(state, op.node, op.host_pages, op.draft_host_pages)
    if isinstance(reserved, Observation):
        return state, (reserved,)
    state, target, draft = reserved
    streams = enqueue_record(state.streams, FORWARD, ("wstart", op.node, -1))
    pending = (*state.pending_layer_writes, LayerWriteState(op.node))
    state = evolve(state, streams=streams, pending_layer_writes=pending)
    return state, _result(op.node, target, draft)


def submit_layer_states(
    state: OracleState, nodes: tuple[int, ...], layer: int, submit_target: bool, submit_draft: bool
) -> Step:
    """``_submit_write_cp_layer_states``: one layer event, one grouped D2H per pool, final acks."""
    config = state.config
    pending = {p.node: p for p in state.pending_layer_writes}
    targets = tuple(
        n
        for n in nodes
        if submit_target and layer < config.layer_num and layer not in pending[n].target_done
    )
    drafts = tuple(
        n
        for n in nodes
        if submit_draft and layer < config.draft_layer_num and layer not in pending[n].draft_done
    )
    if not targets and not drafts:
        return state, ()
    active = tuple(dict.fromkeys(targets + drafts))
    streams = enqueue_record(state.streams, FORWARD, ("wlayer", layer, -1))
    if not config.variant.no_fence_before_d2h:
        for node in active:
            streams = enqueue_wait(streams, WRITE, ("wstart", node, -1))
        streams = enqueue_wait(streams, WRITE, ("wlayer", layer, -1))
    state = evolve(state, streams=streams)
    for group, channel in ((targets, layer), (drafts, config.layer_num + layer)):
        if group:
            pairs = tuple(pair for n in group for pair in _pairs_for(state, n, channel))
            copy = CopyPages("d2h", channel, group, pairs)
            state = evolve(state, streams=enqueue(state.streams, WRITE, copy))
            for node in group:
                record = state.nodes[node]
                channels = tuple(sorted({*record.backup_channels, channel}))
                state = with_node(state, node, evolve(record, backup_channels=channels))
    updated = tuple(
        evolve(
            p,
            target_done=tuple(sorted({*p.target_done, layer}))
            if p.node in targets
            else p.target_done,
            draft_done=tuple(sorted({*p.draft_done, layer})) if p.node in drafts else p.draft_done,
        )
        for p in state.pending_layer_writes
    )
    state = evolve(state, pending_layer_writes=updated)
    finals = tuple(p.node for p in updated if p.node in active and _step_thinks_done(config, p))
    for node in finals:
        streams = enqueue_record(state.streams, WRITE, ("wfin", node, -1))
        state = evolve(state, streams=streams)
        state = _append_write_ack(state, node, 1)
    remaining = tuple(p for p in state.pending_layer_writes if p.node not in finals)
    return evolve(state, pending_layer_writes=remaining), ()


def process_on_layer_end(state: OracleState, layer: int, source: str) -> Step:
    """``on_layer_end(layer, source)``: submit ``layer`` of every pending per-layer write."""
    nodes = tuple(p.node for p in state.pending_layer_writes)
    if not nodes:
        return state, ()
    return submit_layer_states(state, nodes, layer, source == "target", source == "draft")


def process_cancel_layer_write(state: OracleState, node: int) -> Step:
    """``cancel_layer_write_state`` (pop + synchronize), then the tree's ``evict_cp_host``."""
    variant = state.config.variant
    if not variant.cancel_keeps_layer_state:
        remaining = tuple(p for p in state.pending_layer_writes if p.node != node)
        state = evolve(state, pending_layer_writes=remaining)
    observations: tuple[Observation, ...] = ()
    # A harness reported the copies the cancel's synchronize ran; any still queued now were
    # not drained, and the free below flags them (INV-07)
    if not variant.cancel_without_sync and not state.config.harness_schedule:
        state, observations = synchronize_stream(state, WRITE)
    state = free_host_pages(state, node)
    record = state.nodes[node]
    rolled_back = evolve(
        record,
        lifecycle="device_only",
        host_pages=(),
        draft_host_pages=(),
        page_owners=(),
        backup_channels=(),
        lock_ref=record.lock_ref - 1,
    )
    state = with_node(state, node, rolled_back)
    cancelled = tuple(sorted({*state.cancelled, node}))
    return evolve(state, cancelled=cancelled), (*observations, Observation("cancelled", node))


def process_drain_write_acks(state: OracleState, tree_count: int | None = None) -> Step:
    """``writing_check``: pop the MIN-over-ranks FIFO prefix of completed acks, unlock nodes.

    ``tree_count`` (a harness's drain): pop that many instead; ``check_drained_ack`` records an
    INV-09 fault for each one that was not completed.
    """
    streams = state.streams
    if tree_count is not None:
        count = min(tree_count, *(len(queue) for queue in state.write_acks))
    elif state.config.variant.drain_ignores_finish:
        count = min(len(queue) for queue in state.write_acks)
    else:
        count = min(
            compute_drainable_prefix(tuple(is_event_complete(streams, a.finish) for a in queue))
            for queue in state.write_acks
        )
    if count == 0:
        return state, ()
    drained = state.write_acks[0][:count]
    for ack in drained:
        state = check_drained_ack(state, ack, "d2h")
    state = evolve(state, write_acks=tuple(queue[count:] for queue in state.write_acks))
    released: list[int] = []
    for ack in drained:
        for node in ack.node_ids:
            state = _finish_backup(state, node)
            released.append(node)
    return state, (Observation("drained_write", values=tuple(released)),)


def check_drained_ack(state: OracleState, ack: Ack, direction: str) -> OracleState:
    """Record INV-09 faults if ``ack`` is drained before its event or its copies completed."""
    # Verify the drained ack's finish event completed (INV-09: FIFO prefix of completed acks)
    if not is_event_complete(state.streams, ack.finish):
        state = with_fault(
            state,
            "INV-09",
            f"ack {ack.node_ids} drained before its finish event {ack.finish} completed",
        )
    # Verify the drained ack's transfer landed (INV-09)
    for node in ack.node_ids:
        if has_pending_copy(state.streams, node, None, direction):
            state = with_fault(
                state,
                "INV-09",
                f"ack for node {node} drained while its {direction} copy is still queued",
            )
    return state


def _finish_backup(state: OracleState, node: int) -> OracleState:
    record = state.nodes[node]
    # Verify the ack releases a write in flight (INV-02: a second ack would pop nothing)
    if record.lifecycle != "backup_in_flight":
        return with_fault(
            state,
            "INV-02",
            f"write ack for node {node} drained but the node has no write in flight "
            f"(lifecycle {record.lifecycle}); a second ack for one write",
        )
    host_holders = state.host_holders
    for pool, per_rank in enumerate((record.host_pages, record.draft_host_pages)):
        if per_rank:
            owned = tuple(
                set_holders(host_holders[pool][rank], pages, node)
                for rank, pages in enumerate(per_rank)
            )
            host_holders = replace_at(host_holders, pool, owned)
    state = evolve(state, host_holders=host_holders)
    done = evolve(record, lifecycle="backed_up", backup_channels=(), lock_ref=record.lock_ref - 1)
    return with_node(state, node, done)
