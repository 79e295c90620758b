"""The shape of a harness rule record, what a rule may see of its case, and the shared pieces.

``StepContext`` (what a rule reads and drives of the case it is applied to: the config, the
world, the tree driver, the storage driver, the capabilities, the candidates; ``Session`` is
one) -> ``Param`` (one drawn argument: a Hypothesis strategy for the machine, a seeded sample
for the CP-process schedule and the vector walks) -> ``Draw`` (a rule's params, how they become
step arguments, when drawing makes sense) -> ``RuleRecord`` (one atomic rule: family,
``why_not``, ``process``, ``candidates``, ``draw``, the oracle translation, the session checks
around it, and what the vectors need: its argument types, what it reads of the streams'
progress, its walk weight) -> the shared helpers: a node argument, a layer in range, a pick
among candidates, whether copies are queued. The records themselves are in the family modules
(``forward.py`` ... ``storage.py``), every one by name in ``table.RULES``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from hypothesis import strategies as st

from hicache_ref.harness.step_types import Outcome, RuleName, StepArg
from hicache_ref.oracle.config import Pool

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver
    from hicache_ref.harness.driver.tree import TreeDriver
    from hicache_ref.harness.world.config import HarnessConfig
    from hicache_ref.harness.world.world import World
    from hicache_ref.oracle import ops as o

Args = Mapping[str, StepArg]
STREAMS = ("forward", "write", "load")
MULTI_CONSUMER = "multi_consumer"
RESET_DRAINS = "reset_drains"


# -- what a rule sees of its case ---------------------------------------------------------------
class StepContext(Protocol):
    """What a rule may read and drive of the case it is applied to (``Session`` is one).

    Rules never import the session: they see its world, its tree driver (the radix cache's
    side), its storage driver (the L3 side of a storage world, else None), the capabilities the
    implementation declared, and the candidates of a rule (cached per step)."""

    @property
    def config(self) -> HarnessConfig: ...
    @property
    def world(self) -> World: ...
    @property
    def tree(self) -> TreeDriver: ...
    @property
    def storage(self) -> StorageDriver | None: ...
    @property
    def capabilities(self) -> frozenset[str]: ...
    def candidates(self, rule: str) -> list[int]: ...


# -- drawn arguments ----------------------------------------------------------------------------
SMALL_RANGE = 127
"""Hypothesis draws a bounded integer of at most this span as one plain choice."""


def draw_small_int(data: Any, lo: int, hi: int) -> int:
    """``data.draw(st.integers(lo, hi))`` as one choice, without the strategy's span.

    Inside the machine's rule draw (a strategy's ``do_draw``) every index and argument was a
    nested ``data.draw`` with its own span and validation: a tenth of Hypothesis' time per
    step. For ranges of at most ``SMALL_RANGE`` the integer strategy makes exactly this
    choice, so a saved example still replays as the same program; only the argument's own
    span goes (the step's draw stays one span). Wider ranges keep the strategy (it weights
    the bounds)."""
    if hi - lo > SMALL_RANGE:
        return int(data.draw(integers_once(lo, hi)))
    return int(data.draw_integer(lo, hi))


@functools.cache
def integers_once(lo: int, hi: int) -> st.SearchStrategy[int]:
    """``st.integers(lo, hi)``, built once per bounds (a strategy built per draw is validated
    per draw: that was a fifth of drawing a configuration)."""
    return st.integers(lo, hi)


@functools.cache
def _int_lists(lo: int, hi: int, min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(integers_once(lo, hi), min_size=min_size, max_size=max_size)


@dataclass(frozen=True)
class Ints:
    """An integer in ``[lo, hi]``."""

    lo: int
    hi: int

    def strategy(self) -> st.SearchStrategy[Any]:
        return st.integers(self.lo, self.hi)

    def draw(self, data: Any) -> Any:
        return draw_small_int(data, self.lo, self.hi)

    def sample(self, rng: random.Random) -> Any:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Bools:
    """True or False."""

    def strategy(self) -> st.SearchStrategy[Any]:
        return st.booleans()

    def draw(self, data: Any) -> Any:
        return data.draw_boolean()

    def sample(self, rng: random.Random) -> Any:
        return rng.random() < 0.5


@dataclass(frozen=True)
class OneOf:
    """One of ``values``."""

    values: tuple[StepArg, ...]

    def strategy(self) -> st.SearchStrategy[Any]:
        return st.sampled_from(self.values)

    def draw(self, data: Any) -> Any:
        return self.values[draw_small_int(data, 0, len(self.values) - 1)]

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values)


@dataclass(frozen=True)
class IntLists:
    """A list of ``min_size``..``max_size`` integers in ``[lo, hi]``."""

    lo: int
    hi: int
    min_size: int
    max_size: int

    def strategy(self) -> st.SearchStrategy[Any]:
        return _int_lists(self.lo, self.hi, self.min_size, self.max_size)

    def draw(self, data: Any) -> Any:
        return data.draw(self.strategy())

    def sample(self, rng: random.Random) -> Any:
        size = rng.randint(self.min_size, self.max_size)
        return [rng.randint(self.lo, self.hi) for _ in range(size)]


Param = Ints | Bools | OneOf | IntLists
PICK = Ints(0, 63)
"""Which candidate a rule acts on (modulo the candidates)."""


def sample_params(params: Mapping[str, Param], rng: random.Random) -> dict[str, Any]:
    """Every param drawn from a seeded generator (the CP-process schedule, the vector walks)."""
    return {name: param.sample(rng) for name, param in params.items()}


@dataclass(frozen=True)
class Draw:
    """How a schedule draws a rule's arguments (the machine and the CP-process schedule)."""

    params: Mapping[str, Param]
    choose: Callable[[StepContext, Mapping[str, Any]], dict[str, StepArg] | None]
    """The step's arguments from the drawn values (None: nothing to do with them now)."""
    offered: Callable[[StepContext], bool]
    """The precondition: whether drawing this rule can make sense now."""
    in_machine: bool = True
    """The Hypothesis machine draws the rule atomically (False: it reaches it only through
    compound programs; the CP-process schedule draws it by its weight)."""

    @property
    def strategies(self) -> dict[str, st.SearchStrategy[Any]]:
        return {name: param.strategy() for name, param in self.params.items()}


# -- the oracle's side of a rule ------------------------------------------------------------------
class OracleView(Protocol):
    """What a rule's oracle translation may ask the lockstep oracle (``lockstep.py``)."""

    def node_id(self, handle: int) -> int: ...
    def prefill_ops(self, handle: int, outcome: Outcome) -> list[o.Op]: ...
    def forward_layer_ops(self) -> list[o.Op]: ...
    def backup_op(self, handle: int, refused: bool, early: bool) -> o.Op: ...
    def load_op(self, handle: int) -> o.Op: ...
    def drain_ops(self, write: bool, load: bool) -> list[o.Op]: ...


Translate = Callable[[OracleView, Args, Outcome], "Sequence[o.Op]"]


class UntranslatedRuleError(Exception):
    """A rule the oracle cannot follow (the lockstep oracle turns off for the case)."""


def untranslated(view: OracleView, args: Args, outcome: Outcome) -> Sequence[o.Op]:
    """The default translation: the oracle cannot express this rule."""
    raise UntranslatedRuleError("the rule has no oracle translation")


def no_oracle_ops(view: OracleView, args: Args, outcome: Outcome) -> Sequence[o.Op]:
    """Device work only (fed as executions), or a step that changes nothing the oracle models."""
    return ()


# -- what the vectors read of a rule ------------------------------------------------------------
ArgType = Literal["int", "bool", "str", "stream", "handles"]
"""The type of a step argument (a trace's arguments are checked against it: bad input)."""
Queue = Literal["write", "load"]
Returned = Literal["nothing", "new_node", "device_pages", "host_slots"]
"""What the implementation hands back when it applies a step: a prefill's new node (its pages,
maybe an early reservation's host slots), a load's device pages, a backup's host slots."""


@dataclass(frozen=True)
class Completion:
    """What a rule reads of how far the streams got (``vectors/settle.py`` keeps a vector's
    answer the same on every conforming implementation)."""

    drains: tuple[Queue, ...] = ()
    """The ack queues whose finished prefix it drains (its answer depends on finished acks)."""
    in_flight: tuple[Queue, ...] = ()
    """It is enabled only while a copy of one of these queues is still queued."""
    synchronizes: bool = False
    """The host waits for the stream its ``stream`` argument names."""

    @property
    def reads(self) -> Literal["nothing", "acks", "in_flight"]:
        return "acks" if self.drains else "in_flight" if self.in_flight else "nothing"


READS_NOTHING = Completion()
BOTH_QUEUES: tuple[Queue, ...] = ("write", "load")
Sample = Callable[[StepContext, random.Random], "dict[str, StepArg] | None"]


def no_requirements(ctx: StepContext, args: Args) -> frozenset[str]:
    return frozenset()


@dataclass(frozen=True)
class RuleRecord:
    """One atomic rule: everything the machine, the session, lockstep and the CP-process
    schedule need to know about it."""

    name: RuleName
    family: str  # the campaign report's family (``campaign.RULE_FAMILIES`` is derived)
    doc: str
    why_not: Callable[[StepContext, Args], str | None]
    process: Callable[[StepContext, Args], Outcome]
    candidates: Callable[[StepContext], list[int]] | None = None
    draw: Draw | None = None
    oracle: Translate = untranslated
    """Which oracle ops the applied step is (``lockstep.py``)."""
    feeds_first: bool = False
    """The call runs queued device work before its own effect (a reset and a cancel synchronize
    the streams first): lockstep feeds the executions before the rule's ops."""
    weight: int = 0
    """How often the CP-process schedule draws it (0: never; ``distributed/schedule.py``)."""
    reserves: bool = False
    """It reserves host slots on every CP rank at once (the ranks agree that it fits first)."""
    pins: Callable[[StepContext, Args], Args] | None = None
    """Arguments the session fixes when the step is applied (a prefill names its node)."""
    refusable: bool = False  # a refused outcome must change nothing (INV-17)
    probe: bool = False  # a misuse probe: needs ``guards``; the snapshot must not change
    resets: bool = False  # RESET_CHECKS (INV-18) run after it; the node ids restart
    # what a trace and a vector need to know of it
    args: Mapping[str, ArgType] = field(default_factory=lambda: MappingProxyType({}))
    """The step arguments it reads, with their types (``cli_inputs.STEP_ARGUMENTS`` is the
    union over every rule: a trace whose argument has the wrong type is bad input)."""
    completion: Completion = READS_NOTHING
    """What it reads of the streams' progress (``vectors/settle.py``)."""
    walk: float = 1.0
    """How often a seeded vector walk picks it among the enabled rules (0: never; oracle
    traces and stories apply it; ``vectors/walks.py``)."""
    sample: Sample | None = None
    """A walk's arguments for a rule that has no ``draw`` (a prefill, a noop)."""
    returns: Returned = "nothing"
    """What the implementation hands back when it applies the step (``vectors/observe.py``)."""
    requires: Callable[[StepContext, Args], frozenset[str]] = no_requirements
    """Capabilities a vector that applies the step needs beyond those its config implies."""


# -- shared pieces ------------------------------------------------------------------------------
def node_arg(args: Args) -> int:
    return int(args.get("node", -1))


def layer_limit(ctx: StepContext, draft: bool) -> int:
    return ctx.config.draft_layer_num if draft else ctx.config.layer_num


def undrained_loads(ctx: StepContext) -> int:
    return len(ctx.world.ranks[0].controller.ack_load_queue)


def device_busy(ctx: StepContext) -> bool:
    return not ctx.world.device.is_idle()


def copies_queued(ctx: StepContext) -> bool:
    """Whether a write or load stream of some rank still has work queued."""
    return any(
        not stream.query()
        for rank in ctx.world.ranks
        for stream in (rank.controller.write_stream, rank.controller.load_stream)
    )


def pick_candidate(ctx: StepContext, rule: str, pick: int) -> int:
    candidates = ctx.candidates(rule)
    return candidates[pick % len(candidates)]


def candidate_rule(rule: str, what: str) -> Callable[[StepContext, Args], str | None]:
    """``why_not`` of a rule that acts on one node among its candidates."""

    def why_not(ctx: StepContext, args: Args) -> str | None:
        if node_arg(args) not in ctx.candidates(rule):
            return f"node {node_arg(args)} is not {what}"
        return None

    return why_not


def pick_draw(rule: str) -> Draw:
    """Draw ``pick`` in [0, 64) and act on that candidate (modulo the candidates)."""
    return Draw(
        {"pick": PICK},
        lambda s, d: {"node": pick_candidate(s, rule, int(d["pick"]))},
        lambda s: bool(s.candidates(rule)),
    )


def always(ctx: StepContext, args: Args) -> str | None:
    return None


def no_args(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {}


def needs_per_layer_write(ctx: StepContext) -> str | None:
    if not ctx.world.per_layer_write:
        return "early reservations and layer-end-driven writes need per_layer_write"
    return None


def layer_in_range(ctx: StepContext, args: Args, stored: int | None = None) -> str | None:
    draft = bool(args.get("draft", False))
    limit = layer_limit(ctx, draft)
    if stored is not None:
        limit = min(limit, stored)
    layer = int(args.get("layer", -1))
    if not 0 <= layer < limit:
        return f"layer {layer} is outside [0, {limit}) of the {'draft' if draft else 'target'}"
    return None


def parse_handles(args: Args) -> list[int] | None:
    try:
        return [int(part) for part in str(args.get("nodes", "")).split(",") if part.strip()]
    except ValueError:
        return None


def pool_arg(args: Args) -> Pool:
    return "draft" if bool(args["draft"]) else "target"


def offered_always(ctx: StepContext) -> bool:
    return True


def draw_only_outside_machine(draw: Draw) -> Draw:
    """A draw the CP-process schedule uses; the Hypothesis machine reaches the rule through
    compound programs only (``steps/programs.py``)."""
    return Draw(draw.params, draw.choose, draw.offered, in_machine=False)


def oracle_drains(write: bool, load: bool) -> Translate:
    """The oracle ops of a drain of the write and/or the load acks."""
    return lambda view, args, outcome: view.drain_ops(write, load)


NODE_ARG: Mapping[str, ArgType] = MappingProxyType({"node": "int"})
LAYER_ARGS: Mapping[str, ArgType] = MappingProxyType({"layer": "int", "draft": "bool"})
NODE_LAYER_ARGS: Mapping[str, ArgType] = MappingProxyType({**NODE_ARG, **LAYER_ARGS})
STREAM_ARG: Mapping[str, ArgType] = MappingProxyType({"stream": "stream"})
