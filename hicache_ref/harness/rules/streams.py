"""The streams family: the device runs queued work, and the host waits for it.

``advance`` (n queued ops of one stream, on every rank for the copy streams) ->
``advance_to_record`` (up to and including the stream's next event record: an ack or a layer
becomes visible while the ops behind it stay queued) -> ``synchronize`` (the host waits for
one stream). The forward is its own stream under overlap scheduling; the controller's event
records then sit on the default stream the tree calls it from, which runs beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hicache_ref.device.protocol import StreamT
from hicache_ref.harness.adapters.base import ControllerLike
from hicache_ref.harness.rules.record import (
    STREAM_ARG,
    STREAMS,
    Args,
    Completion,
    Draw,
    Ints,
    OneOf,
    RuleRecord,
    StepContext,
    device_busy,
    draw_only_outside_machine,
    no_oracle_ops,
)
from hicache_ref.harness.step_types import Outcome, StepArg, done
from hicache_ref.harness.world.world import World


def _forward_side(world: World) -> list[StreamT]:
    """The forward stream, and the default stream the tree calls the controller from when
    the forward has its own (it holds only the controller's event records then)."""
    forward, default = world.forward_stream, world.device.default_stream
    return [forward] if forward is default else [forward, default]


def _stream(controller: ControllerLike, stream: str) -> StreamT:
    return controller.write_stream if stream == "write" else controller.load_stream


def _choose_stream(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {"stream": str(drawn["stream"])}


# -- advance ------------------------------------------------------------------------------------
def _rule_advance(ctx: StepContext, args: Args) -> str | None:
    if args.get("stream") not in STREAMS or int(args.get("n", 0)) < 1:
        return f"advance needs a stream in {STREAMS} and n >= 1"
    return None


def advance(world: World, stream: str, n: int) -> Outcome:
    """Run ``n`` queued ops of one stream (on every rank for the copy streams)."""
    device = world.device
    agreed = f"{stream} ran some op(s)"  # how many is rank-local
    if stream == "forward":  # and the caller's stream, when the forward has its own
        forward_ran = sum(device.advance(s, n) for s in _forward_side(world))
        return done(f"forward ran {forward_ran} op(s)", agreed=agreed)
    ran = [device.advance(_stream(rank.controller, stream), n) for rank in world.ranks]
    return done(f"{stream} ran {ran} op(s)", agreed=agreed)


def process_advance(ctx: StepContext, args: Args) -> Outcome:
    return advance(ctx.world, str(args["stream"]), int(args["n"]))


def _choose_advance(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {"stream": str(drawn["stream"]), "n": int(drawn["n"])}


ADVANCE = RuleRecord(
    "advance",
    "streams",
    "run n queued ops of one stream",
    _rule_advance,
    process_advance,
    draw=Draw({"stream": OneOf(STREAMS), "n": Ints(1, 16)}, _choose_advance, device_busy),
    oracle=no_oracle_ops,  # device work: fed as executions
    weight=8,
    args=MappingProxyType({"stream": "stream", "n": "int"}),
    walk=2.5,
)


# -- advance_to_record --------------------------------------------------------------------------
def _rule_advance_to_record(ctx: StepContext, args: Args) -> str | None:
    if args.get("stream") not in STREAMS:
        return f"advance_to_record needs a stream in {STREAMS}"
    return None


def advance_to_record(world: World, stream: str) -> Outcome:
    """Run one stream (on every rank for the copy streams) up to and including its next
    event record: the boundary where an ack or a layer becomes visible, with the ops behind
    it still queued."""
    device = world.device
    agreed = f"{stream} ran to its next record"
    if stream == "forward":
        ran = device.advance_to_record(device.default_stream)
        return done(f"forward ran {ran} op(s) to its next record", agreed=agreed)
    counts = [device.advance_to_record(_stream(rank.controller, stream)) for rank in world.ranks]
    return done(f"{stream} ran {counts} op(s) to its next record", agreed=agreed)


def process_advance_to_record(ctx: StepContext, args: Args) -> Outcome:
    return advance_to_record(ctx.world, str(args["stream"]))


ADVANCE_TO_RECORD = RuleRecord(
    "advance_to_record",
    "streams",
    "run one stream up to and including its next event record (an ack or a layer becomes "
    "visible while the ops behind it stay queued)",
    _rule_advance_to_record,
    process_advance_to_record,
    draw=Draw({"stream": OneOf(STREAMS)}, _choose_stream, device_busy),
    oracle=no_oracle_ops,  # device work: fed as executions
    weight=4,
    args=STREAM_ARG,
)


# -- synchronize --------------------------------------------------------------------------------
def _rule_synchronize(ctx: StepContext, args: Args) -> str | None:
    return None if args.get("stream") in STREAMS else f"synchronize needs a stream in {STREAMS}"


def synchronize(world: World, stream: str) -> Outcome:
    """Host waits for a stream (what cancel_layer_write_state and a CPU read do)."""
    if stream == "forward":
        for forward in _forward_side(world):
            forward.synchronize()
    else:
        for rank in world.ranks:
            _stream(rank.controller, stream).synchronize()
    return done(f"synchronized {stream}")


def process_synchronize(ctx: StepContext, args: Args) -> Outcome:
    return synchronize(ctx.world, str(args["stream"]))


SYNCHRONIZE = RuleRecord(
    "synchronize",
    "streams",
    "the host waits for one stream",
    _rule_synchronize,
    process_synchronize,
    draw=draw_only_outside_machine(Draw({"stream": OneOf(STREAMS)}, _choose_stream, device_busy)),
    oracle=no_oracle_ops,  # device work: fed as executions
    weight=3,
    args=STREAM_ARG,
    completion=Completion(synchronizes=True),
    walk=3.0,
)

RECORDS: tuple[RuleRecord, ...] = (ADVANCE, ADVANCE_TO_RECORD, SYNCHRONIZE)
