"""Compound programs: protocol stories built from atomic steps, shared by every schedule.

A ``Program`` draws its ``params`` once, then ``run`` yields one atomic step at a time; the
schedule applies each step before asking for the next, so a program sees the world its earlier
steps made (a node it wrote is a candidate to evict once the ack drained). The Hypothesis machine
turns every program with ``in_machine`` into a rule of the same name; the CP-process schedule
draws programs by ``weight`` beside the atomic records. Steps name their rule through its record
(``rules/write.WRITE``), never by spelling it.

The stories, in the order data flows: ``new_request`` (a prefill, and compute) -> ``compute``
(one layer of the forward batch or all) -> ``offload`` (write -> sync -> drain -> evict_device)
-> ``early_reserve`` (an early CP reservation, maybe a layer submitted) -> ``reload`` /
``reload_staggered`` (loads, reads while they load, part of the H2D) -> ``round_trip`` (device
-> host -> device, repeated) -> ``cancel_and_reuse`` (roll back, scribble the freed slots, let
the write stream run) -> ``scheduler_check`` (maybe flush writes, drain both ack queues) ->
``storage_round_trip`` / ``storage_steps`` (L3: ``storage_programs.py``).
``new_request`` and ``round_trip`` are always offered, so swarm testing never leaves a case with
nothing to do, and the reload programs keep the load path, where shipped corruption
lives, above a fifth of the applied steps (``LOAD_PATH_SHARE_MIN``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from hicache_ref.harness.rules.evict import EVICT_DEVICE
from hicache_ref.harness.rules.forward import FORWARD_LAYER, PREFILL
from hicache_ref.harness.rules.load import (
    DRAIN_ACKS,
    DRAIN_LOAD,
    FORWARD_READ,
    FORWARD_READ_BATCH,
    LOAD,
    START_LOADING,
)
from hicache_ref.harness.rules.misuse import SCRIBBLE_FREE_HOST
from hicache_ref.harness.rules.record import (
    PICK,
    Bools,
    IntLists,
    Ints,
    Param,
    RuleRecord,
    StepContext,
)
from hicache_ref.harness.rules.streams import ADVANCE, SYNCHRONIZE
from hicache_ref.harness.rules.write import CANCEL, RESERVE, START_WRITING, SUBMIT_LAYER, WRITE
from hicache_ref.harness.step_types import StepArg
from hicache_ref.harness.steps.storage_programs import (
    STORAGE_ROUND_TRIP_PARAMS,
    STORAGE_STEPS_PARAMS,
    run_storage_round_trip,
    run_storage_steps,
    storage_attached,
    storage_runnable,
)
from hicache_ref.harness.steps.trace import Step

Steps = Iterator[Step]


class ProgramContext(StepContext, Protocol):
    """What a program sees of its case: what a rule sees, and whether a step may run now."""

    def is_enabled(self, step: Step) -> bool: ...


LOAD_PATH_SHARE_MIN = 0.20  # of applied steps, on the reference (tests/harness/test_rules.py)


@dataclass(frozen=True)
class Program:
    """A compound story: drawn once, applied one atomic step at a time."""

    name: str
    doc: str
    params: Mapping[str, Param]
    offered: Callable[[ProgramContext], bool]
    run: Callable[[ProgramContext, Mapping[str, Any]], Steps]
    weight: int = 0  # the CP-process schedule's weight (0: not drawn there)
    in_machine: bool = True  # the Hypothesis machine has a rule for it


def atomic_steps(record: RuleRecord) -> Callable[[ProgramContext, Mapping[str, Any]], Steps]:
    """The one-step story of an atomic record with a draw: its step with the arguments its
    ``choose`` makes of the drawn values (none when they make nothing to do now)."""
    draw = record.draw
    assert draw is not None, f"rule {record.name} has no draw"

    def run(session: ProgramContext, drawn: Mapping[str, Any]) -> Steps:
        args = draw.choose(session, drawn)
        if args is not None:
            yield Step(rule=record.name, args=args)

    return run


def step(record: RuleRecord, **args: StepArg) -> Step:
    """A step of one atomic rule."""
    return Step(rule=record.name, args=dict(args))


def _has(session: ProgramContext, record: RuleRecord) -> bool:
    return bool(session.candidates(record.name))


def _pick(session: ProgramContext, record: RuleRecord, pick: int) -> int:
    candidates = session.candidates(record.name)
    return candidates[pick % len(candidates)]


def _always(session: ProgramContext) -> bool:
    return True


def _layer_kinds(session: ProgramContext) -> list[tuple[bool, int]]:
    config = session.config
    return [(False, config.layer_num)] + [(True, config.draft_layer_num)] * config.has_draft


def early_reserve_allowed(session: ProgramContext) -> bool:
    """An early CP reservation inside a prefill needs every rank in this process (across
    processes the ranks could not agree on a reservation decided inside the step)."""
    return session.config.uses_cp and len(session.world.ranks) == session.config.num_ranks


# -- the forward --------------------------------------------------------------------------------
def run_prefill(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """A request's prefill; ``small`` keeps a CP node within one page per rank (zero-owned ranks
    are common); with ``compute_now`` the forward runs every layer."""
    config, tokens = session.config, int(p["tokens"])
    if bool(p["small"]) and config.uses_cp:
        tokens = 1 + (tokens - 1) % (config.page_size * config.cp_size)
    early = bool(p["early_reserve"]) and early_reserve_allowed(session)
    yield step(PREFILL, tokens=tokens, early_reserve=early)
    while bool(p["compute_now"]) and session.tree.batch:
        yield step(FORWARD_LAYER)


def run_forward_layer(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    yield step(FORWARD_LAYER)
    while bool(p["all_layers"]) and session.tree.batch_layer > 0:
        yield step(FORWARD_LAYER)


# -- write back ---------------------------------------------------------------------------------
def run_offload(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """write -> the host syncs the write stream -> drain -> evict_device."""
    node = _pick(session, WRITE, int(p["pick"]))
    yield step(WRITE, node=node)
    yield step(SYNCHRONIZE, stream="write")
    yield step(DRAIN_ACKS)
    if node in session.candidates(EVICT_DEVICE.name):
        yield step(EVICT_DEVICE, node=node)


def _reservable(session: ProgramContext) -> list[int]:
    return session.tree.handles(lambda n: n.on_device and n.backup == "none")


def run_reserve(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """An early CP reservation of an existing node; a stored layer 0 maybe submitted (a layer's
    D2H only after its KV store: the layer-end hook's order, INV-12)."""
    handles = _reservable(session)
    node = handles[int(p["pick"]) % len(handles)]
    yield step(RESERVE, node=node)
    if session.tree.nodes[node].layers_stored > 0 and bool(p["submit"]):
        yield step(SUBMIT_LAYER, node=node, layer=0, draft=False)


def run_cancel_and_reuse(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """Roll back a pending per-layer backup (its host slots are freed) -> the CPU scribbles
    every free host slot while copies are queued -> part of the write stream runs (a copy still
    writing a freed slot overwrites the scribble)."""
    yield step(CANCEL, node=_pick(session, CANCEL, int(p["pick"])))
    if session.is_enabled(step(SCRIBBLE_FREE_HOST)):
        yield step(SCRIBBLE_FREE_HOST)
    if int(p["run_ops"]):
        yield step(ADVANCE, stream="write", n=int(p["run_ops"]))


def run_drain_acks(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """The scheduler's per-step check: maybe flush queued writes, then drain both queues."""
    if bool(p["flush_writes"]):
        yield step(START_WRITING)
    yield step(DRAIN_ACKS)


# -- load back ----------------------------------------------------------------------------------
def _load_some(
    session: ProgramContext, picks: list[int], start_each: bool = False
) -> Iterator[Step]:
    for pick in picks:
        if _has(session, LOAD):
            yield step(LOAD, node=_pick(session, LOAD, pick))
            if start_each and session.is_enabled(step(START_LOADING)):
                yield step(START_LOADING)


def _loaded_by(session: ProgramContext, steps: list[Step]) -> list[int]:
    return [int(s.args["node"]) for s in steps if s.rule == LOAD.name]


def _start_and_read(
    session: ProgramContext, loaded: list[int], reads: int, run_ops: int, drain: bool
) -> Steps:
    """start_loading -> reads of the loading nodes at once (they must wait on the per-layer
    events) -> part of the H2D and of the forward runs -> maybe drain."""
    if session.is_enabled(step(START_LOADING)):
        yield step(START_LOADING)
    kinds = _layer_kinds(session)
    for i in range(reads if loaded else 0):
        node = loaded[i % len(loaded)]
        draft, layer_num = kinds[(i // len(loaded)) % len(kinds)]
        layer = (i // (len(loaded) * len(kinds))) % layer_num
        if node in session.candidates(FORWARD_READ.name):
            yield step(FORWARD_READ, node=node, layer=layer, draft=draft)
    yield from _run_some(run_ops, drain)


def _run_some(run_ops: int, drain: bool) -> Steps:
    if run_ops:
        yield step(ADVANCE, stream="load", n=run_ops)
        yield step(ADVANCE, stream="forward", n=run_ops)
    if drain:
        yield step(DRAIN_LOAD)


def run_reload(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """Load up to three nodes -> one start_loading (their ops merged) -> reads while they load
    -> part of the H2D runs -> maybe drain."""
    loads: list[Step] = []
    for s in _load_some(session, list(p["picks"])):
        loads.append(s)
        yield s
    loaded = _loaded_by(session, loads)
    yield from _start_and_read(
        session, loaded, int(p["reads"]), int(p["run_ops"]), bool(p["drain"])
    )


def run_reload_staggered(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """Up to three nodes, each loaded by its own start_loading (a producer slot each) -> reads
    of all of them in one batch (``forward_read_batch``: one wait that must cover every slot's
    layer event; one read per node without ``multi_consumer``) -> part of the H2D runs -> maybe
    drain."""
    loads: list[Step] = []
    for s in _load_some(session, list(p["picks"]), start_each=True):
        loads.append(s)
        yield s
    loaded = _loaded_by(session, loads)
    kinds = _layer_kinds(session)
    for i in range(int(p["reads"]) if len(loaded) >= 2 else 0):
        draft, layer_num = kinds[i % len(kinds)]
        layer = (i // len(kinds)) % layer_num
        nodes = ",".join(map(str, loaded))
        batch = step(FORWARD_READ_BATCH, nodes=nodes, layer=layer, draft=draft)
        if session.is_enabled(batch):
            yield batch
            continue
        for node in loaded:
            single = step(FORWARD_READ, node=node, layer=layer, draft=draft)
            if session.is_enabled(single):
                yield single
    yield from _run_some(int(p["run_ops"]), bool(p["drain"]))


def run_round_trip(session: ProgramContext, p: Mapping[str, Any]) -> Steps:
    """A device node goes to host and comes back, ``cycles`` times: (a new node's prefill and
    forward when none is ready) -> write -> sync -> drain -> (evict_device -> load ->
    start_loading -> reads while it loads -> part of the H2D -> sync -> drain_load) x cycles;
    maybe a last sync and drain."""
    if not (_has(session, WRITE) or _has(session, EVICT_DEVICE)):
        yield step(PREFILL, tokens=int(p["tokens"]), early_reserve=False)
        while session.tree.batch:
            yield step(FORWARD_LAYER)
    if not (_has(session, WRITE) or _has(session, EVICT_DEVICE)):
        return  # the device is full: the prefill was refused
    if _has(session, WRITE):
        node = _pick(session, WRITE, int(p["pick"]))
        yield step(WRITE, node=node)
        yield step(SYNCHRONIZE, stream="write")
        yield step(DRAIN_ACKS)
    else:
        node = _pick(session, EVICT_DEVICE, int(p["pick"]))
    cycles = int(p["cycles"])
    for cycle in range(cycles):
        if node not in session.candidates(EVICT_DEVICE.name):
            return
        yield step(EVICT_DEVICE, node=node)
        if node not in session.candidates(LOAD.name):
            return
        yield step(LOAD, node=node)
        yield from _start_and_read(session, [node], int(p["reads"]), int(p["run_ops"]), False)
        if cycle + 1 < cycles or bool(p["drain"]):
            yield step(SYNCHRONIZE, stream="load")
            yield step(DRAIN_LOAD)


# -- the programs -------------------------------------------------------------------------------
_LOADS: dict[str, Param] = {"reads": Ints(1, 6), "run_ops": Ints(0, 6), "drain": Bools()}
NEW_REQUEST = Program(
    "new_request",
    "a request's prefill; with compute_now the forward runs every layer",
    {"tokens": Ints(1, 40), "small": Bools(), "early_reserve": Bools(), "compute_now": Bools()},
    _always,
    run_prefill,
    weight=10,
)
COMPUTE = Program(
    "compute",
    "one layer of the forward batch, or all of them",
    {"all_layers": Bools()},
    lambda s: bool(s.tree.batch),
    run_forward_layer,
)
OFFLOAD = Program(
    "offload",
    "write -> host syncs the write stream -> drain -> evict_device",
    {"pick": PICK},
    lambda s: _has(s, WRITE),
    run_offload,
    weight=4,
)
EARLY_RESERVE = Program(
    "early_reserve",
    "an early CP reservation of an existing node, maybe a layer submitted",
    {"pick": PICK, "submit": Bools()},
    lambda s: bool(_reservable(s)),
    run_reserve,
    weight=2,
    in_machine=False,
)
RELOAD = Program(
    "reload",
    "load up to three nodes -> one start_loading -> reads while they load -> part of the H2D",
    {"picks": IntLists(0, 63, 1, 3), **_LOADS},
    lambda s: _has(s, LOAD),
    run_reload,
)
RELOAD_STAGGERED = Program(
    "reload_staggered",
    "up to three nodes on a producer slot each -> reads of all in one batch -> part of the H2D",
    {"picks": IntLists(0, 63, 2, 3), **_LOADS},
    lambda s: _has(s, LOAD),
    run_reload_staggered,
)
ROUND_TRIP = Program(
    "round_trip",
    "a device node to host and back, 1-3 times, with reads while it loads",
    {"pick": PICK, "cycles": Ints(1, 3), "tokens": Ints(1, 40), **_LOADS},
    _always,
    run_round_trip,
    weight=8,
)
CANCEL_AND_REUSE = Program(
    "cancel_and_reuse",
    "roll back a pending per-layer backup -> scribble free host slots -> part of the writes",
    {"pick": PICK, "run_ops": Ints(0, 8)},
    lambda s: _has(s, CANCEL),
    run_cancel_and_reuse,
)
SCHEDULER_CHECK = Program(
    "scheduler_check",
    "maybe flush queued writes, then drain both ack queues",
    {"flush_writes": Bools()},
    lambda s: bool(s.tree.ongoing_write or s.tree.ongoing_load),
    run_drain_acks,
)
STORAGE_ROUND_TRIP = Program(
    "storage_round_trip",
    "a chain to L3 and back: write_storage, its backup, a prefetch, storage steps, drains, an end",
    STORAGE_ROUND_TRIP_PARAMS,
    storage_attached,
    lambda s, p: run_storage_round_trip(s, p, LOAD, START_LOADING),
)
STORAGE_STEPS = Program(
    "storage_steps",
    "a few steps of whichever storage threads can run, with drains",
    STORAGE_STEPS_PARAMS,
    storage_runnable,
    run_storage_steps,
)
_PROGRAMS: tuple[Program, ...] = (
    NEW_REQUEST,
    COMPUTE,
    OFFLOAD,
    EARLY_RESERVE,
    RELOAD,
    RELOAD_STAGGERED,
    ROUND_TRIP,
    CANCEL_AND_REUSE,
    SCHEDULER_CHECK,
    STORAGE_ROUND_TRIP,
    STORAGE_STEPS,
)
PROGRAMS: Mapping[str, Program] = MappingProxyType({p.name: p for p in _PROGRAMS})
"""Every compound program by name (the machine's compound rules, in this order)."""
