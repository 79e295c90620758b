"""hicache-fuzz: run campaigns, gate an implementation, replay and minimize traces, and check
the mutant catalogue.

hicache-fuzz run                      # default campaign: reference controller, SimDevice, 60 s
hicache-fuzz run --impl mutant:extra_write_ack --seconds 30 --json report.json
hicache-fuzz run --cp-processes 2 --seconds 60   # CP ranks one per process (gloo; nccl: GPUs)
hicache-fuzz run --device cuda --seconds 60   # the same machines on a GPU, timing perturbed
hicache-fuzz gate --impl sglang --sglang-src DIR --budget 2m --known all
hicache-fuzz replay fuzz/out/failure-reference.jsonl
hicache-fuzz minimize TRACE -o fuzz/corpus/my_finding.jsonl
hicache-fuzz mutants                  # every seeded mutant must be caught
hicache-fuzz setup [--seed FILE]      # fetch sglang 0.5.10 for --impl sglang (and build the fork)

Exit status: 0 when nothing (new) failed, 1 when a campaign, gate or replay failed, 2 on a bad
argument, a bad file or a setup problem: one line on stderr naming it and the fix. The gate
counts failures explained by the known findings it is given (--known; see
hicache_ref/harness/known_findings.py) and fails only on a new one, printing one
``hicache-fuzz replay <trace>`` line for each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hicache_ref.campaign import CampaignReport, run_campaign
from hicache_ref.cli_inputs import (
    UsageError,
    check_out_dir,
    check_output_file,
    check_positive_seconds,
    check_spins_device,
    parse_duration,
    parse_spins,
    read_trace_file,
    use_sglang_src,
)
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness import catalogue
from hicache_ref.harness.adapters.base import unsupported_reasons
from hicache_ref.harness.adapters.registry import checked_implementation, get_implementation
from hicache_ref.harness.known_findings import (
    KNOWN_FINDINGS,
    KnownFinding,
    get_known_findings,
)
from hicache_ref.harness.profiles import PROFILES
from hicache_ref.harness.replay import minimize, replay
from hicache_ref.harness.trace import Trace
from hicache_ref.harness.world import DEVICE_KINDS
from hicache_ref.vectors.cli import add_vectors_parser

__all__ = ["CampaignReport", "main", "run_campaign"]

PROG = "hicache-fuzz"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
GATE_BUDGET_DEFAULT = "120s"


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused command line is one ``UsageError`` line, never the usage block."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see {self.prog} --help")


# -- run and gate ----------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    """A campaign; stops at the first failure unless --keep-going."""
    if args.cp_processes:  # one process per CP rank (hicache_ref/distributed)
        from hicache_ref.distributed.commands import run_cp_command

        if args.spins is not None:
            raise HiCacheInputError(
                "--spins is for a single-process GPU campaign; drop it or --cp-processes"
            )
        return run_cp_command(args)
    report = _campaign(args, seconds=args.seconds, known=())
    print(report.render())
    _write_json(args, report.as_json())
    return EXIT_FAILED if report.failures else EXIT_OK


def cmd_gate(args: argparse.Namespace) -> int:
    """A campaign that counts known findings, and fails only on a new failure."""
    if args.matrix:  # every release of a range, one table (hicache_ref/harness/matrix.py)
        from hicache_ref.harness.matrix import cmd_matrix

        return cmd_matrix(args)
    known = get_known_findings(args.known, args.impl)
    report = _campaign(args, seconds=args.budget, known=known)
    print(report.render(replay_lines=False))
    print(render_gate(report, known))
    _write_json(args, {**report.as_json(), "gate": gate_json(report, known)})
    return EXIT_FAILED if report.failures else EXIT_OK


def render_gate(report: CampaignReport, known: tuple[KnownFinding, ...]) -> str:
    """The verdict: known findings hit (and not hit), then each new failure and its replay."""
    lines = []
    for finding in known:
        hits = report.known_hits[finding.id]
        status = f"hit x{hits}" if hits else "not hit"
        if not finding.covers(report.implementation):
            status += f", it names no {report.implementation!r}"
        lines.append(f"gate: known {finding.id} {status} ({finding.invariant}: {finding.summary})")
    for failure in report.failures:
        again = report.repeats[failure["invariant"]]
        more = f", {again} more like it" if again else ""
        steps = f", {failure['steps']} steps" if "steps" in failure else ""
        lines.append(
            f"gate: NEW {failure['invariant']} (seed {failure['seed']}{steps}{more}): "
            f"{failure['error']}"
        )
        if failure["trace"]:
            lines.append(f"hicache-fuzz replay {failure['trace']}")
        else:  # it failed outside a step, so no trace exists: the seed reproduces it
            lines.append(
                f"  no trace; rerun: hicache-fuzz run --impl {report.implementation} "
                f"--profile {report.profile} --seed {failure['seed']}"
            )
    verdict = (
        f"gate: FAILED: {len(report.failures)} new failure(s)"
        if report.failures
        else f"gate: passed: no new failure in {report.cases} cases ({report.seconds:.0f}s)"
    )
    lines.append(verdict)
    return "\n".join(lines)


def gate_json(report: CampaignReport, known: tuple[KnownFinding, ...]) -> dict[str, Any]:
    return {
        "passed": not report.failures,
        "new_failures": len(report.failures),
        "known_selected": [finding.id for finding in known],
        "known_hits": dict(sorted(report.known_hits.items())),
        "known_not_hit": [f.id for f in known if not report.known_hits[f.id]],
    }


def _campaign(
    args: argparse.Namespace, *, seconds: float, known: tuple[KnownFinding, ...]
) -> CampaignReport:
    """Check every input first, then run; a bad one is a one-line error before any work."""
    out_dir = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    if args.sglang_src:
        use_sglang_src(args.sglang_src)
    if args.sglang_version:
        use_sglang_version(args)
    checked_implementation(args.impl)  # the contract's preflight: a break is exit 2, not a finding
    return run_campaign(
        args.impl,
        seconds=seconds,
        profile=args.profile,
        seed=args.seed,
        out_dir=out_dir,
        stop_on_failure=not args.keep_going,
        progress=not args.no_progress,
        shrink=args.hypothesis_shrink,
        known=known,
        device=args.device,
        perturbation=check_spins_device("--spins", args.spins, args.device),
    )


def use_sglang_version(args: argparse.Namespace) -> None:
    """``--sglang-version X``: that release's wheel (fetched once) is the tree the gate reads."""
    from hicache_ref.harness.adapters.sglang_releases import fetch_release_tree

    if args.sglang_src:
        raise HiCacheInputError("--sglang-src and --sglang-version both name a tree; pass one")
    use_sglang_src(str(fetch_release_tree(args.sglang_version)))


def _write_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"  report: {args.json}")


# -- traces ----------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    trace = _trace_for(args)
    if trace.header.cp_processes:  # recorded across processes: spawn them again
        from hicache_ref.distributed.commands import replay_cp_command

        return replay_cp_command(args, trace, Path(args.trace))
    result = replay(trace, implementation=args.impl, device=args.device)
    for step, outcome in zip(trace.steps, result.outcomes, strict=False):
        print(f"  {step.render():<48} -> {outcome}")
    if result.error is not None:
        print(
            f"FAILED after {result.steps_applied} step(s): {type(result.error).__name__}: {result.error}"
        )
        return EXIT_FAILED
    print(
        f"passed: {len(trace.steps)} step(s) and the quiescence checks ({trace.header.config.describe()})"
    )
    return EXIT_OK


def cmd_minimize(args: argparse.Namespace) -> int:
    output = check_output_file("-o/--output", args.output)
    trace = _trace_for(args)
    if trace.header.cp_processes:  # ddmin replays in one process: it would judge another world
        raise HiCacheInputError(
            f"trace {args.trace} was recorded across {trace.header.cp_processes} processes and "
            "minimize replays in one; replay it with hicache-fuzz replay instead"
        )
    small = minimize(trace, implementation=args.impl, device=args.device)
    path = small.write(output)
    print(f"minimized {len(trace.steps)} -> {len(small.steps)} steps: {path}")
    return EXIT_OK


def _trace_for(args: argparse.Namespace) -> Trace:
    """The trace, checked to replay on its implementation (or --impl) before any step runs."""
    trace = read_trace_file(args.trace)
    if args.sglang_src:
        use_sglang_src(args.sglang_src)
    name = args.impl or trace.header.implementation
    source = trace.header.source if name == trace.header.implementation else ""
    implementation = checked_implementation(name, source)  # the trace's own tree, checked
    reasons = unsupported_reasons(implementation.capabilities, trace.header.config)
    if reasons:
        raise HiCacheInputError(
            f"implementation {name!r} cannot replay trace {args.trace} "
            f"({trace.header.config.describe()}): it lacks {reasons}; pick another --impl"
        )
    return trace


# -- mutants ---------------------------------------------------------------------------------
def _checked_mutants(args: argparse.Namespace) -> int:
    """The catalogue runner, after the same input checks the other subcommands make."""
    check_positive_seconds("--seconds", args.seconds)
    if args.jobs is not None and args.jobs < 1:
        raise HiCacheInputError(f"--jobs {args.jobs} is not positive; give 1 or more processes")
    check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    for name in args.names:
        get_implementation(f"mutant:{name}")  # an unknown name: one line naming the known ones
    for spec in args.impl or ():
        checked_implementation(spec)  # an outside mutant: the contract's preflight first
    return catalogue.cli_mutants(args)


# -- the command line ------------------------------------------------------------------------
def cmd_setup(args: argparse.Namespace) -> int:
    """Fetch the sglang tree the gate reads (once; cached), and build fork trees asked for."""
    from hicache_ref.harness.adapters.sglang_releases import fetch_release_tree
    from hicache_ref.harness.adapters.sglang_tree import SGLANG_VERSION, fork_tree

    tree = fetch_release_tree(args.version or SGLANG_VERSION)
    print(f"sglang {args.version or SGLANG_VERSION}: {tree}")
    for controller in args.seed or []:
        fork = fork_tree(Path(controller), base=tree)
        print(f"fork tree of {controller}: {fork}  (--impl seed --sglang-src {fork})")
    return EXIT_OK


def _add_campaign_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--impl",
        default="reference",
        help="reference | sglang | seed | mutant:<name> | an entry point of the "
        "hicache_ref.implementations group | pkg.module:factory",
    )
    parser.add_argument(
        "--sglang-src",
        metavar="DIR",
        help="an unpacked sglang tree (holds sglang/srt/managers/cache_controller.py) for "
        "--impl sglang / seed; sets HICACHE_SGLANG_SRC",
    )
    parser.add_argument(
        "--sglang-version",
        metavar="X",
        help="an upstream release (0.5.17, 0.5.15.post1) for --impl sglang: its wheel is "
        "fetched once into the cache and gated like --sglang-src",
    )
    parser.add_argument("--profile", default="ci", choices=sorted(PROFILES))
    parser.add_argument(
        "--device",
        default="sim",
        choices=DEVICE_KINDS,
        help="sim (default: SimDevice) or cuda (a GPU, timing perturbed by seeded spins)",
    )
    parser.add_argument(
        "--spins",
        type=parse_spins,
        default=None,
        metavar="P:MIN..MAX",
        help="with --device cuda: spin at each perturbation site with chance P for MIN..MAX "
        "GPU cycles, log-uniform (default 0.5:4096..8388608); recorded in failing traces",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="round k of the campaign uses seed + k (default 0)"
    )
    parser.add_argument("--out", default="fuzz/out", help="where failing traces are written")
    parser.add_argument("--json", metavar="FILE", help="write a machine-readable report here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--hypothesis-shrink",
        action="store_true",
        help="also let Hypothesis shrink failures (can take minutes; ddmin always runs after)",
    )


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSONL trace (fuzz/out/failure-*.jsonl, fuzz/corpus/)")
    parser.add_argument(
        "--impl",
        default=None,
        help="override the trace's implementation (a name, or pkg.module:factory)",
    )
    parser.add_argument("--sglang-src", metavar="DIR", help="as for run: sets HICACHE_SGLANG_SRC")
    parser.add_argument(
        "--device",
        default=None,
        choices=DEVICE_KINDS,
        help="override the trace's device (default: the one its header names)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run a fuzz campaign and print a summary")
    _add_campaign_arguments(run)
    run.add_argument("--seconds", type=parse_duration, default=60.0, help="60, 90s, 2m, ...")
    run.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    run.add_argument(
        "--cp-processes",
        type=int,
        default=0,
        metavar="N",
        help="run CP worlds of N ranks, one process per rank (torch.distributed; N >= 2)",
    )
    run.add_argument(
        "--backend",
        default="gloo",
        help="with --cp-processes: gloo (CPU, default) or nccl (one GPU per rank)",
    )
    run.set_defaults(func=cmd_run)
    gate = sub.add_parser("gate", help="fail only on a failure no known finding explains")
    _add_campaign_arguments(gate)
    gate.add_argument(
        "--budget",
        type=parse_duration,
        default=parse_duration(GATE_BUDGET_DEFAULT),
        help=f"how long to fuzz: 120, 120s, 2m, 1.5m (default {GATE_BUDGET_DEFAULT})",
    )
    gate.add_argument(
        "--known",
        nargs="+",
        default=[],
        metavar="ID",
        help="known-finding ids to count instead of failing on, or 'all' for every entry "
        f"covering --impl (registered: {', '.join(sorted(KNOWN_FINDINGS)) or 'none'})",
    )
    gate.add_argument(
        "--keep-going",
        action="store_true",
        help="look for more after the first new failure (one replay line per distinct invariant)",
    )
    gate.add_argument(
        "--matrix",
        metavar="LO..HI",
        help="gate every upstream release in LO..HI (post releases included) or a comma list, "
        "one table; --known defaults to all (hicache_ref/harness/matrix.py)",
    )
    gate.add_argument(
        "--budget-each",
        type=parse_duration,
        default=None,
        help="with --matrix: how long to fuzz each release (default 60s)",
    )
    gate.set_defaults(func=cmd_gate)
    rep = sub.add_parser("replay", help="replay a trace without Hypothesis")
    _add_trace_arguments(rep)
    rep.set_defaults(func=cmd_replay)
    mini = sub.add_parser("minimize", help="delta-debug a failing trace to fewer steps")
    _add_trace_arguments(mini)
    mini.add_argument("-o", "--output", required=True)
    mini.set_defaults(func=cmd_minimize)
    mut = sub.add_parser("mutants", help="check that every seeded mutant is caught")
    catalogue.add_arguments(mut)
    mut.set_defaults(func=_checked_mutants)
    add_vectors_parser(sub)
    setup = sub.add_parser("setup", help="fetch the sglang wheel the gate reads (cached)")
    setup.add_argument(
        "--sglang-version",
        "--version",
        dest="version",
        help="sglang release to fetch (default 0.5.10; --version is the old spelling)",
    )
    setup.add_argument(
        "--seed",
        nargs="+",
        metavar="FILE",
        help="also build a fork tree with FILE as its cache_controller.py (prints its path)",
    )
    setup.set_defaults(func=cmd_setup)
    return parser


def _with_default_command(argv: list[str], commands: set[str]) -> list[str]:
    """``hicache-fuzz`` and ``hicache-fuzz --seconds 5`` mean ``hicache-fuzz run ...``."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return ["run", *argv]
    if argv[0] not in commands and argv[0] not in ("-h", "--help"):
        raise UsageError(
            f"unknown command {argv[0]!r}; commands: {', '.join(sorted(commands))}; "
            f"see {PROG} --help"
        )
    return argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    commands = set(_subparsers(parser))
    args, extra = parser.parse_known_args(_with_default_command(argv, commands))
    if extra:  # name the subcommand whose help lists the legal flags
        _subparsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            choices: dict[str, argparse.ArgumentParser] = action.choices
            return choices
    return {}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a bad input or setup is one line on stderr and exit status 2."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        func: Callable[[argparse.Namespace], int] = args.func
        return int(func(args))
    except HiCacheInputError as exc:  # a HiCacheSetupError too; any other error is a bug
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
