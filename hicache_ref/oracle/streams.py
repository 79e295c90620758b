"""Streams as FIFOs of abstract operations, events with CUDA's binding rule, and execution.

CUDA semantics kept on purpose (the same as ``device/sim.py``):
- ``query()`` is True for an event with no pending record (never recorded, or all ran);
- a wait binds to the event's most recent record at the time of the wait; a wait on an event
  with no pending record is a no-op and is not queued;
- a wait at the head of a stream blocks it until its record runs; running a record removes
  every wait bound to it, so a queued wait is always blocked.

Executing a head op moves content tags: a store writes the node's tags, a D2H copies device tags
to host, an H2D host tags to device, a read observes them.
"""

from __future__ import annotations

from hicache_ref.oracle.config import FORWARD, LOAD, WRITE
from hicache_ref.oracle.geometry import compute_token_tag
from hicache_ref.oracle.state import (
    CopyPages,
    EventName,
    Observation,
    OracleState,
    ReadKv,
    RecordEvent,
    StoreKv,
    StreamOp,
    WaitEvent,
    evolve,
    replace_at,
    with_fault,
)

Streams = tuple[tuple[StreamOp, ...], ...]


class OracleDeadlock(RuntimeError):
    """A stream waits on a record that no stream will ever run (a bug in the oracle itself)."""


def get_pending_record_seq(streams: Streams, event: EventName) -> int:
    """The seq of the most recent pending record of ``event``, or -1 if none is pending.

    post: __return__ >= -1
    """
    latest = -1
    for queue in streams:
        for op in queue:
            if isinstance(op, RecordEvent) and op.event == event and op.seq > latest:
                latest = op.seq
    return latest


def is_event_complete(streams: Streams, event: EventName | None) -> bool:
    """``event.query()``: no record of it is pending (None stands for a completed ack event).

    post: __return__ == (event is None or get_pending_record_seq(streams, event) == -1)
    """
    return event is None or get_pending_record_seq(streams, event) == -1


def enqueue(streams: Streams, index: int, *ops: StreamOp) -> Streams:
    """``streams`` with ``ops`` appended to stream ``index``.

    pre: 0 <= index < len(streams)
    post: len(__return__[index]) == len(streams[index]) + len(ops)
    """
    queue = streams[index] + ops
    return (*streams[:index], queue, *streams[index + 1 :])


def enqueue_record(streams: Streams, index: int, event: EventName) -> Streams:
    """``event.record()`` on stream ``index``.

    pre: 0 <= index < len(streams)
    post: get_pending_record_seq(__return__, event) == get_pending_record_seq(streams, event) + 1
    """
    seq = get_pending_record_seq(streams, event) + 1
    return enqueue(streams, index, RecordEvent(event, seq))


def enqueue_wait(streams: Streams, index: int, event: EventName) -> Streams:
    """``stream.wait_event(event)``: bind to the latest pending record, or do nothing.

    pre: 0 <= index < len(streams)
    post: len(__return__[index]) - len(streams[index]) == (0 if is_event_complete(streams, event) else 1)
    """
    seq = get_pending_record_seq(streams, event)
    if seq < 0:
        return streams
    return enqueue(streams, index, WaitEvent(event, seq))


def is_head_ready(streams: Streams, index: int) -> bool:
    """Whether stream ``index`` has a head op that can run now.

    pre: 0 <= index < len(streams)
    post: __return__ == (len(streams[index]) > 0 and not isinstance(streams[index][0], WaitEvent))
    """
    queue = streams[index]
    return bool(queue) and not isinstance(queue[0], WaitEvent)


def has_pending_store(streams: Streams, node: int, channel: int) -> bool:
    """Whether a KV store of ``(node, channel)`` is still queued on the forward stream."""
    return any(
        isinstance(op, StoreKv) and op.node == node and op.channel == channel
        for op in streams[FORWARD]
    )


def has_pending_copy(streams: Streams, node: int, channel: int | None, direction: str) -> bool:
    """Whether a ``direction`` copy for ``node`` (of ``channel``, or any) is still queued."""
    index = WRITE if direction == "d2h" else LOAD
    return any(
        isinstance(op, CopyPages)
        and node in op.nodes
        and (channel is None or op.channel == channel)
        for op in streams[index]
    )


def execute_head(state: OracleState, index: int) -> tuple[OracleState, tuple[Observation, ...]]:
    """Run the head op of stream ``index`` (which must be ready) and return what it observed."""
    streams = state.streams
    if not is_head_ready(streams, index):
        raise OracleDeadlock(f"stream {index} has no runnable head op: {streams[index][:1]}")
    head = streams[index][0]
    rest = (*streams[:index], streams[index][1:], *streams[index + 1 :])
    state = evolve(state, streams=rest)
    if isinstance(head, RecordEvent):
        return _run_record(state, head), ()
    if isinstance(head, StoreKv):
        return _run_store(state, head), ()
    if isinstance(head, ReadKv):
        return _run_read(state, head)
    assert isinstance(head, CopyPages)
    return run_copy(state, head)


def _run_record(state: OracleState, record: RecordEvent) -> OracleState:
    """The record ran: every wait bound to it is satisfied and leaves its stream."""
    bound = WaitEvent(record.event, record.seq)
    streams = tuple(tuple(op for op in queue if op != bound) for queue in state.streams)
    return evolve(state, streams=streams)


def _run_store(state: OracleState, store: StoreKv) -> OracleState:
    config = state.config
    ps = config.page_size
    tags = list(state.device_tags[store.channel])
    for position, page in enumerate(store.pages):
        for offset in range(ps):
            token = position * ps + offset
            if token < config.node_tokens[store.node]:
                tags[page * ps + offset] = compute_token_tag(store.node, token, config.token_stride)
    device_tags = replace_at(state.device_tags, store.channel, tuple(tags))
    return evolve(state, device_tags=device_tags)


def _run_read(state: OracleState, read: ReadKv) -> tuple[OracleState, tuple[Observation, ...]]:
    config = state.config
    ps = config.page_size
    seen = tuple(
        state.device_tags[read.channel][page * ps + offset]
        for page in read.pages
        for offset in range(ps)
    )
    expected = tuple(
        compute_token_tag(read.node, token, config.token_stride)
        for token in range(config.node_tokens[read.node])
    )
    observation = Observation("read", read.node, values=seen[: len(expected)])
    # Verify the layer's H2D landed before attention reads it (INV-11, bug class 7/8)
    if has_pending_copy(state.streams, read.node, read.channel, "h2d"):
        state = with_fault(
            state,
            "INV-11",
            f"forward read of channel {read.channel} of node {read.node} ran before that "
            f"layer's H2D landed (the read must wait on the layer's load event)",
        )
    # Verify the read saw the node's KV (INV-06)
    elif seen[: len(expected)] != expected:
        state = with_fault(
            state,
            "INV-06",
            f"forward read of channel {read.channel} of node {read.node} saw tags "
            f"{seen[: len(expected)]}, expected {expected}",
        )
    return state, (observation,)


def run_copy(state: OracleState, copy: CopyPages) -> tuple[OracleState, tuple[Observation, ...]]:
    """Move the tags of every page pair of ``copy`` (D2H: device -> host; H2D: host -> device)."""
    config = state.config
    ps = config.page_size
    channel = copy.channel
    if copy.direction == "d2h":
        # Verify each copied layer was stored before its D2H ran (INV-12, bug class 11)
        for node in copy.nodes:
            if has_pending_store(state.streams, node, channel):
                state = with_fault(
                    state,
                    "INV-12",
                    f"D2H of channel {channel} of node {node} ran while its KV store was still "
                    f"queued on the forward stream (the copy must wait on the store)",
                )
        ranks = [list(per_rank) for per_rank in state.host_tags[channel]]
        for rank, host_page, device_page in copy.pairs:
            for offset in range(ps):
                ranks[rank][host_page * ps + offset] = state.device_tags[channel][
                    device_page * ps + offset
                ]
        host_channel = tuple(tuple(per_rank) for per_rank in ranks)
        state = evolve(state, host_tags=replace_at(state.host_tags, channel, host_channel))
    else:
        tags = list(state.device_tags[channel])
        for rank, host_page, device_page in copy.pairs:
            for offset in range(ps):
                tags[device_page * ps + offset] = state.host_tags[channel][rank][
                    host_page * ps + offset
                ]
        state = evolve(state, device_tags=replace_at(state.device_tags, channel, tuple(tags)))
    moved = tuple(page for pair in copy.pairs for page in pair)
    return state, (Observation(f"copy_{copy.direction}", -1, values=(channel, *moved)),)


def settle_records(state: OracleState) -> OracleState:
    """Run every event record that sits at the head of a stream, until none does."""
    progressed = True
    while progressed:
        progressed = False
        for index, queue in enumerate(state.streams):
            while queue and isinstance(queue[0], RecordEvent):
                state, _ = execute_head(state, index)
                queue = state.streams[index]
                progressed = True
    return state


def run_until_record(
    state: OracleState, event: EventName, seq: int, depth: int = 0
) -> tuple[OracleState, tuple[Observation, ...]]:
    """Advance whatever streams must run so that the record ``(event, seq)`` has run."""
    if depth > 64:
        raise OracleDeadlock(f"wait chain deeper than 64 while running record {event}#{seq}")
    target = RecordEvent(event, seq)
    observations: tuple[Observation, ...] = ()
    while True:
        index = next((i for i, q in enumerate(state.streams) if target in q), None)
        if index is None:
            return state, observations
        state, seen = _advance_or_unblock(state, index, depth)
        observations += seen


def synchronize_stream(
    state: OracleState, index: int
) -> tuple[OracleState, tuple[Observation, ...]]:
    """``stream.synchronize()``: run stream ``index`` (and what it waits on) until empty."""
    observations: tuple[Observation, ...] = ()
    while state.streams[index]:
        state, seen = _advance_or_unblock(state, index, 0)
        observations += seen
    return state, observations


def synchronize_all(state: OracleState) -> tuple[OracleState, tuple[Observation, ...]]:
    """``device.synchronize()``: run every stream until all are empty."""
    observations: tuple[Observation, ...] = ()
    for index in range(len(state.streams)):
        state, seen = synchronize_stream(state, index)
        observations += seen
    return state, observations


def _advance_or_unblock(
    state: OracleState, index: int, depth: int
) -> tuple[OracleState, tuple[Observation, ...]]:
    if is_head_ready(state.streams, index):
        return execute_head(state, index)
    head = state.streams[index][0]
    assert isinstance(head, WaitEvent)
    return run_until_record(state, head.event, head.seq, depth + 1)
