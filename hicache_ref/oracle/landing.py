"""``CopyLanded``: a harness tells the oracle that the device executed one rank's copy.

The oracle finds the queued copy the report matches (same direction and channel, the same page
pairs for that rank), brings its stream up to it (the device evidently passed the waits ahead
of it, so their records run), moves that rank's tags, and settles the stream: records right
behind the copy run, fully landed copies leave. A report that matches no queued copy is a
transfer the oracle did not predict (INV-06); slots that are not whole pages break INV-01.

``ForwardRan``: the device ran the next forward store or read; the oracle runs its forward
stream up to it. A wait ahead of it whose record has not run is a read that passed its layer
gate too early (INV-11).
"""

from __future__ import annotations

from hicache_ref.oracle.config import FORWARD, LOAD, WRITE
from hicache_ref.oracle.geometry import compute_channel, compute_pages_of_slots
from hicache_ref.oracle.ops import CopyLanded
from hicache_ref.oracle.state import (
    CopyPages,
    Observation,
    OracleState,
    ReadKv,
    RecordEvent,
    StoreKv,
    WaitEvent,
    evolve,
    replace_at,
    with_fault,
)
from hicache_ref.oracle.streams import execute_head, run_copy, run_until_record
from hicache_ref.oracle.write_path import Step


def process_copy_landed(state: OracleState, op: CopyLanded) -> Step:
    """Apply a reported copy; see the module docstring."""
    config = state.config
    host_pages = compute_pages_of_slots(op.host_slots, config.page_size)
    device_pages = compute_pages_of_slots(op.device_locs, config.page_size)
    # Verify the reported copy moves whole aligned pages, host and device alike (INV-01)
    if host_pages is None or device_pages is None or len(host_pages) != len(device_pages):
        message = (
            f"{op.direction} copy of layer {op.layer} ({op.pool}) on rank {op.rank} moved "
            f"host slots {op.host_slots} / device locs {op.device_locs}, not whole aligned pages"
        )
        return with_fault(state, "INV-01", message), ()
    reported = frozenset(zip(host_pages, device_pages, strict=True))
    layers = range(config.layers_of(op.pool)) if op.layer is None else (op.layer,)
    observations: tuple[Observation, ...] = ()
    for layer in layers:
        channel = compute_channel(config.layer_num, op.pool == "draft", layer)
        state, seen = _land_one(state, op, channel, reported)
        observations += seen
    return state, observations


def _land_one(
    state: OracleState, op: CopyLanded, channel: int, reported: frozenset[tuple[int, int]]
) -> Step:
    index = WRITE if op.direction == "d2h" else LOAD
    position = _find_match(state.streams[index], op, channel, reported)
    if position is None:
        message = (
            f"{op.direction} copy of channel {channel} on rank {op.rank} with page pairs "
            f"{sorted(reported)} matches no queued copy (the oracle did not predict it)"
        )
        return with_fault(state, "INV-06", message), ()
    if state.config.harness_schedule:
        state, observations = _drop_waits_ahead(state, index, position, op)
    else:
        state, observations = _pass_waits_ahead(state, index, position)
    queue = state.streams[index]
    position = queue.index(_find_op(queue, op, channel, reported))
    copy = queue[position]
    assert isinstance(copy, CopyPages)
    mine = tuple(p for p in copy.pairs if p[0] == op.rank)
    state, seen = run_copy(state, evolve(copy, pairs=mine))
    rest = evolve(copy, pairs=tuple(p for p in copy.pairs if p[0] != op.rank))
    streams = replace_at(state.streams, index, replace_at(queue, position, rest))
    state = _settle(evolve(state, streams=streams), index)
    return state, (*observations, *seen)


def _matches(
    op: object, copy: CopyLanded, channel: int, reported: frozenset[tuple[int, int]]
) -> bool:
    if not isinstance(op, CopyPages) or op.direction != copy.direction or op.channel != channel:
        return False
    mine = frozenset((h, d) for r, h, d in op.pairs if r == copy.rank)
    return bool(mine) and mine == reported


def _find_match(
    queue: tuple[object, ...], op: CopyLanded, channel: int, reported: frozenset[tuple[int, int]]
) -> int | None:
    return next((i for i, q in enumerate(queue) if _matches(q, op, channel, reported)), None)


def _find_op(
    queue: tuple[object, ...], op: CopyLanded, channel: int, reported: frozenset[tuple[int, int]]
) -> object:
    position = _find_match(queue, op, channel, reported)
    assert position is not None, "a matched copy cannot leave its stream while waits run"
    return queue[position]


def _pass_waits_ahead(state: OracleState, index: int, position: int) -> Step:
    """Run the records that the waits ahead of ``position`` are bound to."""
    observations: tuple[Observation, ...] = ()
    for op in state.streams[index][:position]:
        if isinstance(op, WaitEvent):
            state, seen = run_until_record(state, op.event, op.seq)
            observations += seen
    return state, observations


def _drop_waits_ahead(state: OracleState, index: int, position: int, op: CopyLanded) -> Step:
    """A harness reports every op the device ran, so a wait ahead of the landed copy whose
    record has not run is a copy that ran before the event it must wait on: a fault."""
    queue = state.streams[index]
    ahead = [q for q in queue[:position] if isinstance(q, WaitEvent)]
    if not ahead:
        return state, ()
    inv_id, fenced = (
        ("INV-12", "the KV stores it backs up")
        if op.direction == "d2h"
        else ("INV-08", "the forward work still using its device pages")
    )
    # Verify the device ran the copy only after the events its stream waits on (INV-12/INV-08)
    state = with_fault(
        state,
        inv_id,
        f"{op.direction} copy of layer {op.layer} ({op.pool}) on rank {op.rank} ran before "
        f"{[w.event for w in ahead]} was recorded: it is not ordered after {fenced}",
    )
    rest = tuple(q for q in queue if q not in ahead)
    return evolve(state, streams=replace_at(state.streams, index, rest)), ()


def _settle(state: OracleState, index: int) -> OracleState:
    """Pop landed copies and run records at the head of stream ``index``."""
    while state.streams[index]:
        head = state.streams[index][0]
        if isinstance(head, CopyPages) and not head.pairs:
            queue = state.streams[index][1:]
            state = evolve(state, streams=replace_at(state.streams, index, queue))
        elif isinstance(head, RecordEvent):
            state, _ = execute_head(state, index)
        else:
            return state
    return state


def process_forward_ran(state: OracleState) -> Step:
    """Run the forward stream through its next ``StoreKv``/``ReadKv``; see the module docstring."""
    observations: tuple[Observation, ...] = ()
    while True:
        head = state.streams[FORWARD][0]
        if isinstance(head, WaitEvent):
            # Verify the device passed this wait only after its record ran (INV-11, bug class 8)
            state = with_fault(
                state,
                "INV-11",
                f"the forward ran past a wait on {head.event} before that event was recorded "
                f"complete (a read ran before its layer landed)",
            )
            queue = state.streams[FORWARD][1:]
            state = evolve(state, streams=replace_at(state.streams, FORWARD, queue))
            continue
        state, seen = execute_head(state, FORWARD)
        observations += seen
        if isinstance(head, StoreKv | ReadKv):
            return state, observations
