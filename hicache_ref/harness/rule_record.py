"""The shape of a harness rule record, and the pieces many records share.

``RuleRecord`` (one atomic rule: family, ``why_not``, ``process``, ``candidates``, ``draw``
and the session checks around it) -> ``Draw`` (how the machine draws its arguments) -> the
shared helpers: a node argument, a layer in range, a pick among candidates, whether copies are
queued. The records themselves are in ``rules.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st

from hicache_ref.harness.trace import RuleName, StepArg

if TYPE_CHECKING:
    from hicache_ref.harness.session import Session

Args = Mapping[str, StepArg]
STREAMS = ("forward", "write", "load")
PICK = st.integers(0, 63)
MULTI_CONSUMER = "multi_consumer"
RESET_DRAINS = "reset_drains"


@dataclass(frozen=True)
class Draw:
    """How the machine draws a rule's arguments."""

    strategies: Mapping[str, st.SearchStrategy[Any]]
    choose: Callable[[Session, Mapping[str, Any]], dict[str, StepArg] | None]
    """The step's arguments from the drawn values (None: nothing to do with them now)."""
    offered: Callable[[Session], bool]
    """The machine's precondition: whether drawing this rule can make sense now."""


@dataclass(frozen=True)
class RuleRecord:
    """One atomic rule: when it is enabled (and why not), what it does, how it is drawn."""

    name: RuleName
    family: str  # the campaign report's family (``campaign.RULE_FAMILIES``)
    doc: str
    why_not: Callable[[Session, Args], str | None]
    process: Callable[[Session, Args], str]
    candidates: Callable[[Session], list[int]] | None = None
    draw: Draw | None = None
    refusable: bool = False  # a "refused: ..." outcome must change nothing (INV-17)
    probe: bool = False  # a misuse probe: needs ``guards``; the snapshot must not change
    resets: bool = False  # RESET_CHECKS (INV-18) run after it


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
