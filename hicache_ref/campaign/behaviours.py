"""What a campaign has done so far, and when each kind of thing was first and last seen.

A *behaviour* is one rule with one kind of outcome (``write/done``, ``evict_host/refused``,
``load/skipped``: the rule's precondition was false when the step came) or one invariant id
checked (``check/INV-07``). ``Behaviours.absorb`` counts every step and check of a finished
case and stamps the time each behaviour was first and last seen; with the lines and branches
of the implementation first covered (``campaign/coverage.py``) they say when the campaign last did
something new (``get_last_new``), which the report puts at the top of its page: a campaign whose
last new behaviour is long past has stopped learning. A new configuration is a new input, not a
new behaviour: nearly every case draws one, so it is left out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

OUTCOME_KINDS = ("done", "refused", "skipped")
CHECK_PREFIX = "check/"


def get_outcome_kind(text: str) -> str:
    """``done``, ``refused`` (nothing may change) or ``skipped`` (the rule was not enabled)."""
    if text == "skipped":
        return "skipped"
    return "refused" if text.startswith("refused") or "; refused" in text else "done"


@dataclass
class Behaviours:
    """Counts and first/last-seen times (seconds since the campaign began) by behaviour."""

    counts: Counter[str] = field(default_factory=Counter)
    first_s: dict[str, float] = field(default_factory=dict)
    last_s: dict[str, float] = field(default_factory=dict)

    def absorb(self, steps: list[Any], outcomes: list[str], checks: dict[str, int],
               at_s: float | None) -> None:  # fmt: skip
        """One finished case: its steps' rules with their outcomes, its checks by id."""
        seen: Counter[str] = Counter()
        for step, text in zip(steps, outcomes, strict=False):  # a failing step has no outcome
            seen[f"{step.rule}/{get_outcome_kind(text)}"] += 1
        for inv_id, count in checks.items():
            seen[CHECK_PREFIX + inv_id] += count
        self.counts.update(seen)
        if at_s is None:
            return
        at_s = round(at_s, 2)
        for key in seen:
            self.first_s.setdefault(key, at_s)
            self.last_s[key] = at_s

    def merge(self, other: Behaviours) -> None:
        """Add ``other`` (another worker): counts add, the earliest first and latest last win."""
        self.counts.update(other.counts)
        for key, at_s in other.first_s.items():
            self.first_s[key] = min(at_s, self.first_s.get(key, at_s))
        for key, at_s in other.last_s.items():
            self.last_s[key] = max(at_s, self.last_s.get(key, at_s))

    def get_rule(self, rule: str) -> dict[str, Any]:
        """One rule's counts by outcome kind and when it was first and last seen at all."""
        keys = [f"{rule}/{kind}" for kind in OUTCOME_KINDS]
        firsts = [self.first_s[k] for k in keys if k in self.first_s]
        lasts = [self.last_s[k] for k in keys if k in self.last_s]
        return {
            **{kind: self.counts.get(f"{rule}/{kind}", 0) for kind in OUTCOME_KINDS},
            "first_s": min(firsts, default=None),
            "last_s": max(lasts, default=None),
        }

    def get_rules(self) -> list[str]:
        return sorted({key.split("/")[0] for key in self.counts if "/" in key} - {"check"})

    def as_json(self) -> dict[str, Any]:
        return {
            key: [self.counts[key], self.first_s.get(key), self.last_s.get(key)]
            for key in sorted(self.counts)
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Behaviours:
        behaviours = cls()
        for key, (count, first_s, last_s) in data.items():
            behaviours.counts[key] = int(count)
            if first_s is not None:
                behaviours.first_s[key] = float(first_s)
            if last_s is not None:
                behaviours.last_s[key] = float(last_s)
        return behaviours


@dataclass(frozen=True)
class NewBehaviour:
    """The latest first sighting of anything: when, and what it was."""

    at_s: float
    what: str


def get_last_new(behaviours: Behaviours, coverage: dict[str, Any]) -> NewBehaviour | None:
    """The most recent first sighting among behaviours and covered lines and branches."""
    candidates = [NewBehaviour(t, _describe(key)) for key, t in behaviours.first_s.items()]
    for name, seen in coverage.get("files", {}).items():
        candidates += [NewBehaviour(t, f"line {name}:{line}") for line, t in seen["lines"].items()]
        candidates += [
            NewBehaviour(t, f"branch {name}:{arc.replace('>', ' -> ')}")
            for arc, t in seen["arcs"].items()
        ]
    return max(candidates, key=lambda new: new.at_s, default=None)


def _describe(key: str) -> str:
    if key.startswith(CHECK_PREFIX):
        return f"first check of {key[len(CHECK_PREFIX) :]}"
    rule, _, kind = key.partition("/")
    return f"{rule} {kind}"
