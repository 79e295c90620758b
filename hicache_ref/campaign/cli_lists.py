"""``hicache-fuzz list {invariants,known,mutants,rules}``: what the harness knows, without reading
its source.

- ``invariants``: every id with its title (``specs/invariants.md``);
- ``known``: the written-up findings a gate baselines, with the implementations and releases
  each covers, its invariant and what it is (``specs/upstream_findings.md``);
- ``mutants``: the seeded mutants of ``fuzz/mutants/``, each with the ids that must catch it;
- ``rules``: the machine's rules by family (what ``run`` counts as "rules hit").

One line per entry, plain text (``--json`` for a machine), sorted as the specs number them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

LISTS = ("invariants", "known", "mutants", "rules")


def add_list_command(sub: Any) -> None:
    """The ``list`` subcommand's parser."""
    parser = sub.add_parser(
        "list", help="list the invariants, the known findings, the mutants or the rules"
    )
    parser.add_argument("what", choices=LISTS, help="which list to print")
    parser.add_argument("--json", action="store_true", help="one JSON array instead of text")
    parser.set_defaults(func=cmd_list)


def cmd_list(args: argparse.Namespace) -> int:
    rows = LISTERS[args.what]()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    try:
        for row in rows:
            print(ROW_TEXT[args.what](row))
    except BrokenPipeError:  # | head: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # Python flushes stdout at exit: into nothing
    return 0


def get_invariants() -> list[dict[str, Any]]:
    from hicache_ref.invariant_titles import INVARIANT_TITLES

    return [{"id": i, "title": title} for i, title in sorted(INVARIANT_TITLES.items())]


def get_known() -> list[dict[str, Any]]:
    from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS

    return [
        {
            "id": f.id,
            "invariant": f.invariant,
            "implementations": list(f.implementations),
            "releases": f.releases or "every release",
            "summary": f.summary,
        }
        for f in sorted(KNOWN_FINDINGS.values(), key=lambda f: int(f.id.lstrip("F") or 0))
    ]


def get_mutants() -> list[dict[str, Any]]:
    from hicache_ref.harness.adapters.registry import list_mutants, load_mutant_module

    rows = []
    for name in list_mutants():
        module = load_mutant_module(name)
        doc = (module.__doc__ or "").strip().splitlines()
        rows.append(
            {
                "name": name,
                "invariants": list(getattr(module, "INVARIANTS", ())),
                "what": doc[0].removeprefix("Mutant: ") if doc else "",
            }
        )
    return rows


def get_rules() -> list[dict[str, Any]]:
    from hicache_ref.harness.rules import RULES

    return [
        {"rule": name, "family": record.family}
        for name, record in sorted(RULES.items(), key=lambda item: (item[1].family, item[0]))
    ]


LISTERS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "invariants": get_invariants,
    "known": get_known,
    "mutants": get_mutants,
    "rules": get_rules,
}
ROW_TEXT: dict[str, Callable[[dict[str, Any]], str]] = {
    "invariants": lambda r: f"{r['id']}  {r['title']}",
    "known": lambda r: (
        f"{r['id']:<4} {r['invariant']}  {','.join(r['implementations'])} "
        f"({r['releases']}): {r['summary']}"
    ),
    "mutants": lambda r: f"{r['name']:<36} {','.join(r['invariants']):<14} {r['what']}",
    "rules": lambda r: f"{r['family']:<11} {r['rule']}",
}
