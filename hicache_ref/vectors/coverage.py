"""Coverage of a suite: which vectors applied each rule and checked each invariant id.

``Coverage.add`` per vector -> ``missing_rules`` / ``missing_ids`` -> ``render``: the rules x
ids table ``hicache-fuzz vectors generate`` prints. ``INVARIANT_IDS`` are the spec's ids
(``tests/vectors`` keeps them equal to ``specs/invariant_ids.txt``); ``UNREACHABLE`` names the
ids no rule can reach yet, and why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

from hicache_ref.harness.adapters.base import STORAGE_PP_CAPABILITY
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.rules import RULES
from hicache_ref.invariant_titles import INVARIANT_TITLES
from hicache_ref.invariants import checks_storage_pp
from hicache_ref.invariants.checker import collect
from hicache_ref.vectors.models import Vector

INVARIANT_IDS = tuple(sorted(INVARIANT_TITLES))
UNREACHABLE_MODULES: Mapping[str, ModuleType] = {
    STORAGE_PP_CAPABILITY: checks_storage_pp,
}
"""The checker modules whose ids no rule of the harness can reach without a capability the
reference does not declare yet, each under the capability it needs; their ids are exempt while
so (INV-36 was, until the reference held an independent side pool, ``pool_group:swa``; INV-39,
until its tier stored the side pool's window in L3, ``storage:swa``; INV-41, until it ran in
``buffer_only`` host memory with the tree's existence beliefs, ``storage:buffer_only``).
``checks_storage_pp`` judges PP prefetch tickets, which only upstream 0.5.23 has, driven by the
PP gate (``harness/campaigns/pp_gate.py``), not by a rule: a vector's storage checks call it
with no PP ticket to judge, and no story can show it."""
UNREACHABLE: Mapping[str, str] = {
    checker.inv_id: capability
    for capability, module in UNREACHABLE_MODULES.items()
    for checker in collect([vars(module)])
}
"""Each unreachable id with the capability it needs, derived from its module's registrations."""


@dataclass
class Coverage:
    """Which vectors applied each rule and checked each invariant id (the rules x ids table)."""

    by_rule: Counter[str] = field(default_factory=Counter)
    by_id: Counter[str] = field(default_factory=Counter)
    stories_by_id: Counter[str] = field(default_factory=Counter)
    table: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, vector: Vector) -> None:
        for rule in vector.rules:
            self.by_rule[rule] += 1
            row = self.table.setdefault(rule, Counter())
            row.update(vector.invariants)
        self.by_id.update(vector.invariants)
        if vector.kind == "story":
            self.stories_by_id.update({s.inv for s in vector.steps if s.inv})

    def missing_rules(self) -> list[str]:
        return [rule for rule in RULES if not self.by_rule[rule]]

    def missing_ids(self, ids: list[str]) -> list[str]:
        return [i for i in ids if not self.by_id[i] and not self.exempt(i)]

    @staticmethod
    def exempt(inv_id: str) -> bool:
        needs = UNREACHABLE.get(inv_id)
        return needs is not None and needs not in ReferenceImplementation.capabilities

    def render(self, ids: list[str]) -> str:
        short = [i.removeprefix("INV-") for i in ids]
        head = f"{'rule':20} {'vectors':>7} | " + " ".join(f"{s:>4}" for s in short)
        lines = [head, "-" * len(head)]
        for rule in RULES:
            row = self.table.get(rule, Counter())
            cells = " ".join(f"{row[i]:>4}" for i in ids)
            lines.append(f"{rule:20} {self.by_rule[rule]:>7} | {cells}")
        stories = " ".join(f"{self.stories_by_id[i]:>4}" for i in ids)
        lines.append(f"{'stories guarding id':20} {'':>7} | {stories}")
        totals = " ".join(f"{self.by_id[i]:>4}" for i in ids)
        lines.append(f"{'vectors checking id':20} {'':>7} | {totals}")
        for inv_id in ids:
            if not self.by_id[inv_id] and self.exempt(inv_id):
                lines.append(
                    f"{inv_id}: not covered: needs the {UNREACHABLE[inv_id]!r} capability, "
                    "which no harness rule exercises yet"
                )
        missing = self.missing_rules() + self.missing_ids(ids)
        lines.append(
            "coverage: every rule and every reachable invariant id"
            if not missing
            else f"coverage: MISSING {', '.join(missing)}"
        )
        return "\n".join(lines)
