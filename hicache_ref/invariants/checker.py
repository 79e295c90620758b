"""How a checker says which invariant it judges, from what evidence, and in which phases.

``@registered("INV-05", StateView, step=5, quiescence=2)`` over ``check_inv_05_<slug>`` ->
a ``RegisteredChecker`` (still callable as the function was) -> ``collect`` finds every one
in the checker modules and refuses two for one id -> the registry derives ``REGISTERED`` (id ->
function) and each phase's ids (``phase_ids``) from them. Adding an invariant is its spec entry,
its one decorated checker and its bad-state test: no table lists the ids a second time.

A phase keyword's value orders the checkers of that phase (lower first, then by id), so the
first violation reported is the same on every run. The phases, in the order a case meets them:
``step`` (after every applied step), ``refusal`` (around a refused operation), ``reset`` (after
a reset), ``quiescence`` (once every ack drained), ``storage`` (after each storage step, each
reset and at quiescence). A checker with no phase is handed its evidence where the harness
observes it (``CheckRunner.run("INV-xx", evidence)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from hicache_ref.invariants.evidence import Evidence

Phase = Literal["step", "refusal", "reset", "quiescence", "storage"]
PHASES: tuple[Phase, ...] = get_args(Phase)
Check = Callable[[Evidence], None]


@dataclass(frozen=True)
class RegisteredChecker:
    """One invariant's one checker: its id, the evidence kinds it judges, its phases."""

    inv_id: str
    check: Check
    evidence: tuple[type, ...]
    phases: Mapping[Phase, int]

    def __call__(self, evidence: Evidence) -> None:
        self.check(evidence)

    @property
    def __name__(self) -> str:  # the checker's own name, as the spec names it
        return self.check.__name__


def registered(inv_id: str, *evidence: type, **phases: int) -> Callable[[Check], RegisteredChecker]:
    """Register the decorated function as ``inv_id``'s one checker (see the module's doc)."""
    # Verify the phases are known ones (a misspelled phase would leave the checker uncalled)
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"{inv_id}: unknown phase(s) {unknown}; legal: {', '.join(PHASES)}")
    ordered: dict[Phase, int] = {p: phases[p] for p in PHASES if p in phases}

    def wrap(check: Check) -> RegisteredChecker:
        return RegisteredChecker(inv_id, check, evidence, ordered)

    return wrap


def collect(namespaces: Iterable[Mapping[str, object]]) -> tuple[RegisteredChecker, ...]:
    """Every registered checker of the namespaces (modules' ``vars``), in id order."""
    found: dict[str, RegisteredChecker] = {}
    for namespace in namespaces:
        for value in namespace.values():
            if not isinstance(value, RegisteredChecker):
                continue
            held = found.setdefault(value.inv_id, value)
            # Verify one checker per id (a second would judge the same evidence differently)
            if held is not value:
                raise ValueError(
                    f"{value.inv_id} has two checkers, {held.__name__} and {value.__name__}: "
                    "keep one checker per invariant id"
                )
    return tuple(found[inv_id] for inv_id in sorted(found))


def phase_ids(checkers: Iterable[RegisteredChecker], phase: Phase) -> tuple[str, ...]:
    """The ids of one phase, in the order the session runs them."""
    ranked = sorted((c.phases[phase], c.inv_id) for c in checkers if phase in c.phases)
    return tuple(inv_id for _, inv_id in ranked)
