"""Every atomic rule by name: the family modules' records, in the order the report lists them.

A family module (``forward.py`` ... ``storage.py``) ends with ``RECORDS``, its rules in flow
order; ``FAMILY_MODULES`` lists the modules, and ``RULES`` is their records by name. Adding a
rule to a family touches that module alone (and ``step_types.RuleName``, the trace format's names); a new
family is one more module here. The session, the machine, lockstep, the CP-process schedule,
the replayer, the vectors and the campaign report all read ``RULES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, ModuleType

from hicache_ref.harness.rules import (
    evict,
    forward,
    load,
    misuse,
    reset,
    schedule,
    storage,
    streams,
    write,
)
from hicache_ref.harness.rules.record import ArgType, RuleRecord

FAMILY_MODULES: tuple[ModuleType, ...] = (
    forward,
    write,
    load,
    evict,
    streams,
    misuse,
    reset,
    storage,
    schedule,
)
"""The family modules, in the order their rules are listed (the machine's draws, the vector
walks and the campaign report follow it)."""


def _records() -> tuple[RuleRecord, ...]:
    records: list[RuleRecord] = []
    for module in FAMILY_MODULES:
        family: tuple[RuleRecord, ...] = module.RECORDS
        records.extend(family)
    return tuple(records)


RULES: Mapping[str, RuleRecord] = MappingProxyType({r.name: r for r in _records()})
"""Every atomic rule by name, in the order the campaign report and the machine list them."""


def rule_families() -> dict[str, tuple[str, ...]]:
    """The rules of each family (what ``campaign.RULE_FAMILIES`` counts), from the records."""
    families: dict[str, list[str]] = {}
    for record in RULES.values():
        families.setdefault(record.family, []).append(record.name)
    return {family: tuple(names) for family, names in families.items()}


def step_argument_types() -> dict[str, ArgType]:
    """The type of every step argument some rule reads (a trace's arguments are checked
    against it); two rules that read one name read it as one type."""
    types: dict[str, ArgType] = {}
    for record in RULES.values():
        for name, kind in record.args.items():
            # Verify no two records read one argument name as different types
            assert types.setdefault(name, kind) == kind, f"{record.name}: {name} is {kind}?"
    return types
