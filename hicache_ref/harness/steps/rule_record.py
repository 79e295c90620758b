"""The shape of a harness rule record, and the pieces many records share.

``Param`` (one drawn argument: a Hypothesis strategy for the machine, a seeded sample for the
CP-process schedule) -> ``Draw`` (a rule's params, how they become step arguments, when drawing
makes sense) -> ``RuleRecord`` (one atomic rule: family, weight, ``why_not``, ``process``,
``candidates``, ``draw``, the oracle translation and the session checks around it) -> the shared
helpers: a node argument, a layer in range, a pick among candidates, whether copies are queued.
The records themselves are in ``rules.py``, the compound programs in ``programs.py``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hypothesis import strategies as st

from hicache_ref.harness.steps.outcome import Outcome
from hicache_ref.harness.steps.trace import RuleName, StepArg

if TYPE_CHECKING:
    from hicache_ref.harness.steps.session import Session
    from hicache_ref.oracle import ops as o

Args = Mapping[str, StepArg]
STREAMS = ("forward", "write", "load")
MULTI_CONSUMER = "multi_consumer"
RESET_DRAINS = "reset_drains"


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
    """Every param drawn from a seeded generator (the CP-process schedule)."""
    return {name: param.sample(rng) for name, param in params.items()}


@dataclass(frozen=True)
class Draw:
    """How a schedule draws a rule's arguments (the machine and the CP-process schedule)."""

    params: Mapping[str, Param]
    choose: Callable[[Session, Mapping[str, Any]], dict[str, StepArg] | None]
    """The step's arguments from the drawn values (None: nothing to do with them now)."""
    offered: Callable[[Session], bool]
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


@dataclass(frozen=True)
class RuleRecord:
    """One atomic rule: everything the machine, the session, lockstep and the CP-process
    schedule need to know about it."""

    name: RuleName
    family: str  # the campaign report's family (``campaign.RULE_FAMILIES`` is derived)
    doc: str
    why_not: Callable[[Session, Args], str | None]
    process: Callable[[Session, Args], Outcome]
    candidates: Callable[[Session], list[int]] | None = None
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
    pins: Callable[[Session, Args], Args] | None = None
    """Arguments the session fixes when the step is applied (a prefill names its node)."""
    refusable: bool = False  # a refused outcome must change nothing (INV-17)
    probe: bool = False  # a misuse probe: needs ``guards``; the snapshot must not change
    resets: bool = False  # RESET_CHECKS (INV-18) run after it; the node ids restart


# -- shared pieces ------------------------------------------------------------------------------
def node_arg(args: Args) -> int:
    return int(args.get("node", -1))


def layer_limit(session: Session, draft: bool) -> int:
    return session.config.draft_layer_num if draft else session.config.layer_num


def undrained_loads(session: Session) -> int:
    return len(session.world.ranks[0].controller.ack_load_queue)


def device_busy(session: Session) -> bool:
    return not session.world.device.is_idle()


def copies_queued(session: Session) -> bool:
    """Whether a write or load stream of some rank still has work queued."""
    return any(
        not stream.query()
        for rank in session.world.ranks
        for stream in (rank.controller.write_stream, rank.controller.load_stream)
    )


def pick_candidate(session: Session, rule: str, pick: int) -> int:
    candidates = session.candidates(rule)
    return candidates[pick % len(candidates)]


def candidate_rule(rule: str, what: str) -> Callable[[Session, Args], str | None]:
    """``why_not`` of a rule that acts on one node among its candidates."""

    def why_not(session: Session, args: Args) -> str | None:
        if node_arg(args) not in session.candidates(rule):
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


def always(session: Session, args: Args) -> str | None:
    return None


def no_args(session: Session, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {}


def needs_per_layer_write(session: Session) -> str | None:
    if not session.world.per_layer_write:
        return "early reservations and layer-end-driven writes need per_layer_write"
    return None


def layer_in_range(session: Session, args: Args, stored: int | None = None) -> str | None:
    draft = bool(args.get("draft", False))
    limit = layer_limit(session, draft)
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
