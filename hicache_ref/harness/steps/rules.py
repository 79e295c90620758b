"""Every atomic rule of the harness, defined once: one ``RuleRecord`` (``rule_record.py``) per
trace step name, as a module constant (``WRITE``, ``LOAD``, ...) that compound programs and
translated oracle traces name instead of spelling the rule.

A record says, for one rule, in the order a step goes through it:

- ``candidates``: the nodes it may act on now (``Session.candidates``), when it takes a node;
- ``why_not`` (``_rule_<name>``): None when the step may run now, else a short reason, which
  the session records for a skipped step (``Session.why_disabled``, the replayer's
  ``ReplayResult.skipped``), as the oracle's ``_rule_*`` answer ``why_disabled``;
- ``pins``: arguments the session fixes when it applies the step (a prefill's node handle);
- ``process`` (``process_<name>``): what it does to the world (a tree driver verb), returning
  an ``Outcome`` (``outcome.py``: the trace's text, ``refused``, an early ``reservation``);
  flags say which session checks run around it (``refusable``: INV-17 on a refusal, ``probe``:
  a misuse probe, ``resets``: INV-18 after it);
- ``oracle`` (``_oracle_<name>``): the oracle ops the applied step is, for the lockstep oracle
  (``feeds_first``: the device work the call ran goes first);
- ``draw``: how a schedule draws its arguments (``Param``s, then ``choose`` turns the drawn
  values into step arguments against the session); ``weight``: how often the CP-process
  schedule draws it; ``reserves``: CP ranks agree that its reservation fits first.

``Session`` (enabled/apply), the machine (its atomic rules are generated from the records),
lockstep, the CP-process schedule, the replayer and the minimizer all read ``RULES``;
``trace.RuleName`` must name exactly these rules (``tests/harness/test_rules.py``). Rule names
and argument names are a stable format: traces in ``fuzz/corpus`` name them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hicache_ref.harness.driver.probes import ProbeKind
from hicache_ref.harness.steps.outcome import Outcome, done
from hicache_ref.harness.steps.rule_record import (
    MULTI_CONSUMER,
    PICK,
    RESET_DRAINS,
    STREAMS,
    Args,
    Bools,
    Draw,
    IntLists,
    Ints,
    OneOf,
    OracleView,
    RuleRecord,
    always,
    candidate_rule,
    copies_queued,
    device_busy,
    layer_in_range,
    layer_limit,
    needs_per_layer_write,
    no_args,
    no_oracle_ops,
    node_arg,
    parse_handles,
    pick_candidate,
    pick_draw,
    undrained_loads,
)
from hicache_ref.harness.steps.schedule_rules import SCHEDULE_RECORDS
from hicache_ref.harness.steps.storage_rules import STORAGE_RECORDS
from hicache_ref.harness.steps.trace import StepArg
from hicache_ref.oracle import ops as o
from hicache_ref.oracle.config import Pool

if TYPE_CHECKING:
    from hicache_ref.harness.steps.session import Session

__all__ = [
    "MULTI_CONSUMER",
    "RESET_DRAINS",
    "RULES",
    "STREAMS",
    "Draw",
    "RuleRecord",
    "rule_families",
]


# -- the forward --------------------------------------------------------------------------------
def _rule_prefill(session: Session, args: Args) -> str | None:
    if int(args.get("tokens", 0)) < 1:
        return "a prefill needs tokens >= 1"
    handle = int(args.get("handle", session.tree.next_handle))
    if handle in session.tree.nodes:
        return f"handle {handle} is taken"
    return None


def process_prefill(session: Session, args: Args) -> Outcome:
    return session.tree.prefill(
        int(args["tokens"]),
        bool(args.get("early_reserve", False)),
        int(args["handle"]),
        batch=bool(args.get("batch", True)),
    )


def _rule_forward_layer(session: Session, args: Args) -> str | None:
    return None if session.tree.batch else "no forward batch is being computed"


def process_forward_layer(session: Session, args: Args) -> Outcome:
    return session.tree.forward_layer()


def _rule_store_layer(session: Session, args: Args) -> str | None:
    node = session.tree.node(node_arg(args))
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if node.loading:
        return f"node {node_arg(args)} is loading"
    return layer_in_range(session, args)


def process_store_layer(session: Session, args: Args) -> Outcome:
    return session.tree.store_layer(node_arg(args), int(args["layer"]), bool(args["draft"]))


def _rule_layer_end(session: Session, args: Args) -> str | None:
    return needs_per_layer_write(session) or layer_in_range(session, args)


def process_layer_end(session: Session, args: Args) -> Outcome:
    return session.tree.layer_end(int(args["layer"]), bool(args["draft"]))


# -- the write path -----------------------------------------------------------------------------
def _candidates_write(session: Session) -> list[int]:
    total = session.tree.total_layers
    return session.tree.handles(
        lambda n: n.on_device and n.layers_stored == total and n.backup == "none"
    )


def process_write(session: Session, args: Args) -> Outcome:
    return session.tree.write_backup(node_arg(args))


def process_start_writing(session: Session, args: Args) -> Outcome:
    for rank in session.world.ranks:
        rank.controller.start_writing()
    return done("start_writing")


def _rule_reserve(session: Session, args: Args) -> str | None:
    node = session.tree.node(node_arg(args))
    if (why := needs_per_layer_write(session)) is not None:
        return why
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if not session.config.uses_cp or node.backup != "none" or node.loading:
        return f"node {node_arg(args)} has a backup or is loading (or the world has no CP)"
    return None


def process_reserve(session: Session, args: Args) -> Outcome:
    return session.tree.reserve(node_arg(args))


def _rule_submit_layer(session: Session, args: Args) -> str | None:
    node = session.tree.node(node_arg(args))
    if (why := needs_per_layer_write(session)) is not None:
        return why
    if node is None or not node.on_device:
        return f"node {node_arg(args)} is not on device"
    if not node.reservations or node.backup != "in_flight":
        return f"node {node_arg(args)} has no reservation in flight"
    return None


def process_submit_layer(session: Session, args: Args) -> Outcome:
    return session.tree.submit_layer(node_arg(args), int(args["layer"]), bool(args["draft"]))


def process_drain_write(session: Session, args: Args) -> Outcome:
    return session.tree.writing_check()


def _candidates_cancel(session: Session) -> list[int]:
    t = session.tree
    return [h for h in t.handles(lambda n: n.backup == "in_flight") if t.has_pending_layer_write(h)]


def process_cancel(session: Session, args: Args) -> Outcome:
    return session.tree.cancel_backup(node_arg(args))


# -- the load path ------------------------------------------------------------------------------
def _candidates_load(session: Session) -> list[int]:
    if undrained_loads(session) + 1 > session.config.num_counters:
        return []
    return session.tree.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)


def process_load(session: Session, args: Args) -> Outcome:
    return session.tree.load_back(node_arg(args))


def _rule_start_loading(session: Session, args: Args) -> str | None:
    if not session.tree.queued_loads:
        return "no load is queued"
    if undrained_loads(session) >= session.config.num_counters:
        return "every producer slot is held by an undrained load ack (INV-10)"
    return None


def process_start_loading(session: Session, args: Args) -> Outcome:
    return session.tree.start_loading()


def _candidates_forward_read(session: Session) -> list[int]:
    return session.tree.handles(
        lambda n: (
            n.on_device and n.layers_stored > 0 and (not n.loading or n.producer_id is not None)
        )
    )


def _rule_forward_read(session: Session, args: Args) -> str | None:
    node = session.tree.node(node_arg(args))
    if node is None or node_arg(args) not in session.candidates("forward_read"):
        return f"node {node_arg(args)} is not readable (on device, stored, its load started)"
    return layer_in_range(session, args, node.layers_stored)


def process_forward_read(session: Session, args: Args) -> Outcome:
    return session.tree.forward_read(node_arg(args), int(args["layer"]), bool(args["draft"]))


def _choose_forward_read(session: Session, drawn: Mapping[str, Any]) -> dict[str, StepArg] | None:
    handle = pick_candidate(session, "forward_read", int(drawn["pick"]))
    node = session.tree.nodes[handle]
    draft = bool(drawn["draft"]) and session.config.has_draft
    limit = min(layer_limit(session, draft), node.layers_stored)
    if limit <= 0:
        return None
    return {"node": handle, "layer": int(drawn["layer"]) % limit, "draft": draft}


def _rule_forward_read_batch(session: Session, args: Args) -> str | None:
    if MULTI_CONSUMER not in session.capabilities:
        return "set_consumer takes one producer slot here (no multi_consumer)"
    handles = parse_handles(args)
    if handles is None or len(handles) < 2 or len(set(handles)) != len(handles):
        return "a batch reads two or more distinct nodes (nodes='h1,h2,...')"
    readable = session.candidates("forward_read")
    for handle in handles:
        if handle not in readable:
            return f"node {handle} is not readable (on device, stored, its load started)"
    stored = min(session.tree.nodes[h].layers_stored for h in handles)
    return layer_in_range(session, args, stored)


def process_forward_read_batch(session: Session, args: Args) -> Outcome:
    handles = parse_handles(args)
    assert handles is not None
    return session.tree.forward_read_batch(handles, int(args["layer"]), bool(args["draft"]))


def _choose_forward_read_batch(
    session: Session, drawn: Mapping[str, Any]
) -> dict[str, StepArg] | None:
    """Distinct readable nodes: one loading node per producer slot first, then drawn ones."""
    readable = session.candidates("forward_read")
    if len(readable) < 2:
        return None
    nodes = session.tree.nodes
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
    draft = bool(drawn["draft"]) and session.config.has_draft
    limit = min(layer_limit(session, draft), *(nodes[h].layers_stored for h in chosen))
    if limit <= 0:
        return None
    layer = int(drawn["layer"]) % limit
    return {"nodes": ",".join(map(str, chosen)), "layer": layer, "draft": draft}


def process_drain_load(session: Session, args: Args) -> Outcome:
    return session.tree.loading_check()


def process_drain_acks(session: Session, args: Args) -> Outcome:
    return session.tree.writing_check().then(session.tree.loading_check())


# -- eviction -----------------------------------------------------------------------------------
def _candidates_evict_device(session: Session) -> list[int]:
    return session.tree.handles(
        lambda n: n.on_device and n.backup == "done" and not n.loading and n.pending_reads == 0
    )


def process_evict_device(session: Session, args: Args) -> Outcome:
    return session.tree.evict_device(node_arg(args))


def _candidates_drop(session: Session) -> list[int]:
    return session.tree.handles(lambda n: n.on_device and n.backup == "none" and not n.loading)


def process_drop(session: Session, args: Args) -> Outcome:
    return session.tree.drop(node_arg(args))


def _candidates_evict_host(session: Session) -> list[int]:
    return session.tree.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)


def process_evict_host(session: Session, args: Args) -> Outcome:
    return session.tree.evict_host(node_arg(args))


# -- streams and the host -----------------------------------------------------------------------
def _rule_advance(session: Session, args: Args) -> str | None:
    if args.get("stream") not in STREAMS or int(args.get("n", 0)) < 1:
        return f"advance needs a stream in {STREAMS} and n >= 1"
    return None


def process_advance(session: Session, args: Args) -> Outcome:
    return session.advance(str(args["stream"]), int(args["n"]))


def _rule_advance_to_record(session: Session, args: Args) -> str | None:
    if args.get("stream") not in STREAMS:
        return f"advance_to_record needs a stream in {STREAMS}"
    return None


def process_advance_to_record(session: Session, args: Args) -> Outcome:
    return session.advance_to_record(str(args["stream"]))


def _rule_synchronize(session: Session, args: Args) -> str | None:
    return None if args.get("stream") in STREAMS else f"synchronize needs a stream in {STREAMS}"


def process_synchronize(session: Session, args: Args) -> Outcome:
    return session.synchronize(str(args["stream"]))


def _rule_scribble_free_host(session: Session, args: Args) -> str | None:
    return None if device_busy(session) else "no copy is queued (a scribble would race nothing)"


def _offered_scribble(session: Session) -> bool:
    """While a scribble is watched a new one adds little (the machine waits for its horizon)."""
    return copies_queued(session) and not session.tree.watch.active


def process_scribble_free_host(session: Session, args: Args) -> Outcome:
    return session.tree.scribble_free_host()


# -- misuse probes ------------------------------------------------------------------------------
def _candidates_probe_evict_host(session: Session) -> list[int]:
    t = session.tree
    return [h for h in t.handles(lambda n: n.backup == "in_flight") if t.write_in_flight(h)]


def _candidates_probe_evict_device(session: Session) -> list[int]:
    t = session.tree
    return [
        h for h in t.handles(lambda n: n.on_device) if t.write_in_flight(h) or t.load_in_flight(h)
    ]


def _candidates_probe_rewrite(session: Session) -> list[int]:
    return session.tree.handles(lambda n: n.backup == "in_flight" and n.on_device)


def _probe_rule(rule: str, what: str) -> Callable[[Session, Args], str | None]:
    in_candidates = candidate_rule(rule, what)

    def why_not(session: Session, args: Args) -> str | None:
        if "guards" not in session.capabilities:
            return "the implementation refuses nothing (no guards): probes are off"
        return in_candidates(session, args)

    return why_not


def _process_probe(kind: ProbeKind) -> Callable[[Session, Args], Outcome]:
    return lambda session, args: session.tree.probe(kind, node_arg(args))


# -- reset --------------------------------------------------------------------------------------
def process_reset(session: Session, args: Args) -> Outcome:
    return session.tree.reset()


def _rule_reset_in_flight(session: Session, args: Args) -> str | None:
    if RESET_DRAINS not in session.capabilities:
        return "reset() does not wait for its streams here (no reset_drains): use reset"
    return None if device_busy(session) else "no copy is queued (use reset)"


def process_reset_in_flight(session: Session, args: Args) -> Outcome:
    return session.tree.reset_in_flight()


def process_noop(session: Session, args: Args) -> Outcome:
    return done("noop")


def _offered_reset(session: Session) -> bool:
    return len(session.tree.nodes) >= 3


# -- what each rule is to the oracle (``lockstep.py`` feeds these ops) --------------------------
def _pool(args: Args) -> Pool:
    return "draft" if bool(args["draft"]) else "target"


def _oracle_prefill(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [] if outcome.refused else view.prefill_ops(int(args["handle"]), outcome)


def _oracle_forward_layer(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return view.forward_layer_ops()


def _oracle_store_layer(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.Store(view.node_id(node_arg(args)), int(args["layer"]), _pool(args))]


def _oracle_layer_end(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.OnLayerEnd(int(args["layer"]), _pool(args))]


def _oracle_write(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [view.backup_op(node_arg(args), outcome.refused, early=False)]


def _oracle_reserve(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [view.backup_op(node_arg(args), outcome.refused, early=True)]


def _oracle_submit_layer(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.SubmitLayer(view.node_id(node_arg(args)), int(args["layer"]), _pool(args))]


def _oracle_cancel(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.CancelLayerWrite(view.node_id(node_arg(args)))]


def _oracle_load(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [] if outcome.refused else [view.load_op(node_arg(args))]


def _oracle_start_loading(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.StartLoading()]


def _oracle_forward_read(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.ForwardRead(view.node_id(node_arg(args)), int(args["layer"]), _pool(args))]


def _oracle_forward_read_batch(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    layer, pool = int(args["layer"]), _pool(args)
    return [o.ForwardRead(view.node_id(h), layer, pool) for h in parse_handles(args) or ()]


def _oracle_drains(write: bool, load: bool) -> Callable[[OracleView, Args, Outcome], list[o.Op]]:
    return lambda view, args, outcome: view.drain_ops(write, load)


def _oracle_evict_device(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.EvictDevice(view.node_id(node_arg(args)))]


def _oracle_evict_host(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.EvictHost(view.node_id(node_arg(args)))]


def _oracle_reset(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.Reset()]


def _pin_prefill(session: Session, args: Args) -> Args:
    """Name the node in the step itself, so deleting earlier steps (ddmin) keeps every later
    reference to it valid."""
    return args if "handle" in args else {**args, "handle": session.tree.next_handle}


def _offered_batch(session: Session) -> bool:
    return bool(session.tree.batch)


def _choose_advance(session: Session, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {"stream": str(drawn["stream"]), "n": int(drawn["n"])}


def _choose_stream(session: Session, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {"stream": str(drawn["stream"])}


def _offered_write_or_load_acks(session: Session) -> bool:
    return bool(session.tree.ongoing_write or session.tree.ongoing_load)


def _offered_always(session: Session) -> bool:
    return True


def _draw_only_outside_machine(draw: Draw) -> Draw:
    """A draw the CP-process schedule uses; the Hypothesis machine reaches the rule through
    compound programs only (``programs.py``)."""
    return Draw(draw.params, draw.choose, draw.offered, in_machine=False)


# -- the records --------------------------------------------------------------------------------
PREFILL = RuleRecord(
    "prefill",
    "forward",
    "a request's prefill: new pages (the forward stores them layer by layer)",
    _rule_prefill,
    process_prefill,
    oracle=_oracle_prefill,
    pins=_pin_prefill,
    refusable=True,
)
FORWARD_LAYER = RuleRecord(
    "forward_layer",
    "forward",
    "one layer of the forward batch: every node's store, then the layer hooks",
    _rule_forward_layer,
    process_forward_layer,
    draw=_draw_only_outside_machine(Draw({}, no_args, _offered_batch)),
    oracle=_oracle_forward_layer,
    weight=8,
)
STORE_LAYER = RuleRecord(
    "store_layer",
    "forward",
    "one layer's KV store of one node (oracle traces)",
    _rule_store_layer,
    process_store_layer,
    oracle=_oracle_store_layer,
)
LAYER_END = RuleRecord(
    "layer_end",
    "forward",
    "the pools' layer-end hooks (drive pending per-layer writes)",
    _rule_layer_end,
    process_layer_end,
    oracle=_oracle_layer_end,
)
WRITE = RuleRecord(
    "write",
    "write path",
    "back up a computed device node (write / reserve_write_cp + submit)",
    candidate_rule("write", "on device, computed and not backed up"),
    process_write,
    candidates=_candidates_write,
    draw=pick_draw("write"),
    oracle=_oracle_write,
    weight=6,
    reserves=True,
    refusable=True,
)
START_WRITING = RuleRecord(
    "start_writing",
    "write path",
    "flush queued writes",
    always,
    process_start_writing,
    draw=_draw_only_outside_machine(Draw({}, no_args, _offered_always)),
    oracle=no_oracle_ops,  # write() and the CP writes already issued their copies
    weight=1,
)
RESERVE = RuleRecord(
    "reserve",
    "write path",
    "an early CP reservation of an existing node",
    _rule_reserve,
    process_reserve,
    oracle=_oracle_reserve,
    reserves=True,
    refusable=True,
)
SUBMIT_LAYER = RuleRecord(
    "submit_layer",
    "write path",
    "submit one layer of a reserved node",
    _rule_submit_layer,
    process_submit_layer,
    oracle=_oracle_submit_layer,
)
DRAIN_WRITE = RuleRecord(
    "drain_write",
    "write path",
    "drain the ready prefix of the write acks",
    always,
    process_drain_write,
    draw=_draw_only_outside_machine(Draw({}, no_args, _offered_always)),
    oracle=_oracle_drains(write=True, load=False),
    weight=2,
)
CANCEL = RuleRecord(
    "cancel",
    "write path",
    "roll back a pending per-layer backup, then free its host slots",
    candidate_rule("cancel", "backing up with a pending per-layer write"),
    process_cancel,
    candidates=_candidates_cancel,
    draw=pick_draw("cancel"),
    oracle=_oracle_cancel,
    feeds_first=True,  # the rollback synchronizes the write stream first
    weight=2,
)
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
)
START_LOADING = RuleRecord(
    "start_loading",
    "load path",
    "start the queued loads on one producer slot",
    _rule_start_loading,
    process_start_loading,
    draw=Draw({}, no_args, lambda s: bool(s.tree.queued_loads)),
    oracle=_oracle_start_loading,
    weight=4,
)
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
)
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
)
DRAIN_LOAD = RuleRecord(
    "drain_load",
    "load path",
    "drain the ready prefix of the load acks",
    always,
    process_drain_load,
    draw=_draw_only_outside_machine(Draw({}, no_args, _offered_always)),
    oracle=_oracle_drains(write=False, load=True),
    weight=2,
)
DRAIN_ACKS = RuleRecord(
    "drain_acks",
    "acks",
    "the scheduler's per-step check: drain both ack queues",
    always,
    process_drain_acks,
    draw=_draw_only_outside_machine(Draw({}, no_args, _offered_always)),
    oracle=_oracle_drains(write=True, load=True),
    weight=8,
)
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
)
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
)
EVICT_HOST = RuleRecord(
    "evict_host",
    "eviction",
    "free a host-only node's host copy",
    candidate_rule("evict_host", "host only and not loading"),
    process_evict_host,
    candidates=_candidates_evict_host,
    draw=pick_draw("evict_host"),
    oracle=_oracle_evict_host,
    weight=2,
)
ADVANCE = RuleRecord(
    "advance",
    "streams",
    "run n queued ops of one stream",
    _rule_advance,
    process_advance,
    draw=Draw({"stream": OneOf(STREAMS), "n": Ints(1, 16)}, _choose_advance, device_busy),
    oracle=no_oracle_ops,  # device work: fed as executions
    weight=8,
)
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
)
SYNCHRONIZE = RuleRecord(
    "synchronize",
    "streams",
    "the host waits for one stream",
    _rule_synchronize,
    process_synchronize,
    draw=_draw_only_outside_machine(Draw({"stream": OneOf(STREAMS)}, _choose_stream, device_busy)),
    oracle=no_oracle_ops,  # device work: fed as executions
    weight=3,
)
SCRIBBLE_FREE_HOST = RuleRecord(
    "scribble_free_host",
    "eviction",
    "the CPU writes into every free host slot while copies are queued",
    _rule_scribble_free_host,
    process_scribble_free_host,
    draw=Draw({}, no_args, _offered_scribble),
    oracle=no_oracle_ops,  # free slots only, whose content the oracle does not predict
)
PROBE_EVICT_HOST = RuleRecord(
    "probe_evict_host",
    "misuse",
    "evict_host of a node whose backup is in flight: must be refused (INV-07/INV-15)",
    _probe_rule("probe_evict_host", "backing up with its copy in flight"),
    _process_probe("host_free"),
    candidates=_candidates_probe_evict_host,
    draw=pick_draw("probe_evict_host"),
    oracle=no_oracle_ops,  # refused: it changes nothing (INV-17)
    weight=1,
    probe=True,
)
PROBE_EVICT_DEVICE = RuleRecord(
    "probe_evict_device",
    "misuse",
    "evict_device of a node whose copy is in flight: must be refused (INV-08)",
    _probe_rule("probe_evict_device", "on device with a copy in flight"),
    _process_probe("device_free"),
    candidates=_candidates_probe_evict_device,
    draw=pick_draw("probe_evict_device"),
    oracle=no_oracle_ops,
    weight=1,
    probe=True,
)
PROBE_REWRITE = RuleRecord(
    "probe_rewrite",
    "misuse",
    "a second backup of a node whose backup is in flight: must be refused (INV-02)",
    _probe_rule("probe_rewrite", "on device with its backup in flight"),
    _process_probe("rewrite"),
    candidates=_candidates_probe_rewrite,
    draw=pick_draw("probe_rewrite"),
    oracle=no_oracle_ops,
    weight=1,
    probe=True,
)
RESET = RuleRecord(
    "reset",
    "other",
    "tree reset at idle",
    always,
    process_reset,
    draw=Draw({}, no_args, _offered_reset),
    oracle=_oracle_reset,
    feeds_first=True,  # the tree runs the device to idle first
    weight=1,
    resets=True,
)
RESET_IN_FLIGHT = RuleRecord(
    "reset_in_flight",
    "other",
    "tree reset with copies queued (the implementation's reset must drain its streams)",
    _rule_reset_in_flight,
    process_reset_in_flight,
    draw=Draw(
        {},
        no_args,
        lambda s: RESET_DRAINS in s.capabilities and _offered_reset(s) and copies_queued(s),
    ),
    oracle=_oracle_reset,
    feeds_first=True,
    resets=True,
)
NOOP = RuleRecord(
    "noop",
    "other",
    "nothing (an oracle op with no call)",
    always,
    process_noop,
    oracle=no_oracle_ops,
)

_RECORDS: tuple[RuleRecord, ...] = (
    PREFILL,
    FORWARD_LAYER,
    STORE_LAYER,
    LAYER_END,
    WRITE,
    START_WRITING,
    RESERVE,
    SUBMIT_LAYER,
    DRAIN_WRITE,
    CANCEL,
    LOAD,
    START_LOADING,
    FORWARD_READ,
    FORWARD_READ_BATCH,
    DRAIN_LOAD,
    DRAIN_ACKS,
    EVICT_DEVICE,
    DROP,
    EVICT_HOST,
    ADVANCE,
    ADVANCE_TO_RECORD,
    SYNCHRONIZE,
    SCRIBBLE_FREE_HOST,
    PROBE_EVICT_HOST,
    PROBE_EVICT_DEVICE,
    PROBE_REWRITE,
    RESET,
    RESET_IN_FLIGHT,
    NOOP,
    *STORAGE_RECORDS,  # the storage family (storage_rules.py)
    *SCHEDULE_RECORDS,  # the schedule family (schedule_rules.py)
)

RULES: Mapping[str, RuleRecord] = MappingProxyType({r.name: r for r in _RECORDS})
"""Every atomic rule by name, in the order the campaign report and the machine list them."""


def rule_families() -> dict[str, tuple[str, ...]]:
    """The rules of each family (what ``campaign.RULE_FAMILIES`` counts), from the records."""
    families: dict[str, list[str]] = {}
    for record in _RECORDS:
        families.setdefault(record.family, []).append(record.name)
    return {family: tuple(names) for family, names in families.items()}
