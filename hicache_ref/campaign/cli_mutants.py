"""``hicache-fuzz mutants``: every seeded mutant must be caught, by an invariant it declares.

The subcommand's options and its runner, over ``catalogue.run_catalogue`` (which knows
nothing of argparse). Inputs are checked first, as for every subcommand: a bad one is one line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hicache_ref.campaign.budgets import add_cases_argument
from hicache_ref.campaign.catalogue import run_catalogue
from hicache_ref.campaign.cli_inputs import add_budget_argument, check_out_dir, check_output_file
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.mutant import GUARDS
from hicache_ref.harness.adapters.registry import checked_implementation, get_implementation
from hicache_ref.harness.campaigns.profiles import PROFILES, get_profile_help
from hicache_ref.harness.world.world import DEVICE_KINDS

MUTANT_BUDGET_DEFAULT = "20s"


def add_mutants_command(sub: Any) -> None:
    """The ``mutants`` subcommand's parser."""
    parser = sub.add_parser("mutants", help="check that every seeded mutant is caught")
    parser.add_argument("names", nargs="*", help="mutants to run (default: the whole catalogue)")
    parser.add_argument(
        "--impl",
        action="append",
        metavar="SPEC",
        help="an outside mutant (pkg.module:factory, or an entry point name of the "
        "hicache_ref.implementations group) to run as a catalogue row; repeatable",
    )
    add_budget_argument(parser, MUTANT_BUDGET_DEFAULT, what="per mutant: at most")
    add_cases_argument(
        parser,
        "end each mutant's campaign after N cases, or at --budget, whichever comes first: a "
        "fixed --seed then searches the same cases however busy the host is (the slowest "
        "mutant falls at case 247 at seed 0; the catalogue test runs 600)",
    )
    parser.add_argument(
        "--profile",
        default="ci",
        choices=sorted(PROFILES),
        help=get_profile_help(),
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="round k of each campaign uses seed + k (default 0)"
    )
    parser.add_argument("--out", default="fuzz/out", help="where failing traces are written")
    parser.add_argument("--json", metavar="FILE", help="write a machine-readable report here")
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument(
        "--no-guards",
        action="store_true",
        help=f"switch the {GUARDS!r} capability off (probes disabled, as for upstream SGLang); "
        "mutants with NEEDS_GUARDS = True are skipped",
    )
    parser.add_argument(
        "--device",
        default="sim",
        choices=DEVICE_KINDS,
        help="sim (default) or cuda: the catalogue on a GPU with timing perturbation, one "
        "mutant at a time (NEEDS_GUARDS and SimDevice-built mutants are skipped there)",
    )
    parser.set_defaults(func=cmd_mutants)


def cmd_mutants(args: argparse.Namespace) -> int:
    """Print the catalogue table; 1 if a mutant survived or fired an undeclared invariant."""
    if args.jobs is not None and args.jobs < 1:
        raise HiCacheInputError(f"--jobs {args.jobs} is not positive; give 1 or more processes")
    out_dir = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    for name in args.names:
        get_implementation(f"mutant:{name}")  # an unknown name: one line naming the known ones
    for spec in args.impl or ():
        checked_implementation(spec)  # an outside mutant: the contract's preflight first
    report = run_catalogue(
        [*args.names, *(args.impl or ())] or None,
        seconds=args.budget,
        cases_max=args.max_cases,
        profile=args.profile,
        seed=args.seed,
        out_dir=out_dir,
        guards=not args.no_guards,
        jobs=args.jobs,
        device=args.device,
    )
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        print(f"report: {args.json}")
    return 0 if report.is_clean() else 1
