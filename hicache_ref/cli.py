"""hicache-fuzz: run campaigns, gate an implementation, replay and minimize traces, and check
the mutant catalogue.

hicache-fuzz run                      # default campaign: reference controller, SimDevice, 60 s
hicache-fuzz run --impl mutant:extra_write_ack --budget 30 --json report.json
hicache-fuzz run --workers 2 --shard 1/4 --database redis://ci-redis:6379 --json shard1.json
hicache-fuzz run --cp-processes 2 --budget 60   # CP ranks one per process (gloo; nccl: GPUs)
hicache-fuzz run --device cuda --budget 60   # the same machines on a GPU, timing perturbed
hicache-fuzz gate --impl sglang --sglang-src DIR --budget 2m   # written-up findings baselined
hicache-fuzz gate --impl sglang --max-cases 400 --budget 15m   # 400 cases however busy the host
hicache-fuzz replay fuzz/out/failure-reference-seed3-<digest>-min.jsonl
hicache-fuzz replay fuzz/out/pp-failure-sglang-seed0-<digest>.jsonl   # a PP gate's program
hicache-fuzz minimize TRACE -o fuzz/corpus/my_finding.jsonl
hicache-fuzz mutants                  # every seeded mutant must be caught
hicache-fuzz report shard*.json -o report.html   # one page: plots, coverage, failures
hicache-fuzz traces --database redis://ci-redis:6379 -o fuzz/out   # the fleet's failure traces
hicache-fuzz setup [--seed FILE]      # fetch sglang 0.5.10 for --impl sglang (and build the fork)
hicache-fuzz setup --from sglang-0.5.23-py3-none-any.whl   # offline: a wheel or a tree, cached
hicache-fuzz list invariants          # or known, mutants, rules
hicache-fuzz --version

Exit status: 0 when nothing (new) failed, 1 when a campaign, gate or replay failed, 2 on a bad
argument, a bad file or a setup problem: one line on stderr naming it and the fix (a mistyped
command or flag gets the nearest one); 130 when Ctrl-C or SIGINT ended a campaign, 143 when
SIGTERM did (its summary and --json report say what ran; the last line says INTERRUPTED).
The gate counts failures explained by known findings (--known, by default those written up for
the implementation gated; hicache-fuzz list known) and fails only on a new one, printing one
replay line for each, runnable as printed. On a tree with storage:pp (0.5.23's PP prefetch
tickets) a fifth of the budget goes to the PP gate, whose failure is a new one too.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hicache_ref import __version__
from hicache_ref.campaign.budgets import add_cases_argument, split_cases
from hicache_ref.campaign.cli_inputs import (
    TREE_IMPLEMENTATIONS,
    UsageError,
    add_budget_argument,
    check_out_dir,
    check_output_file,
    check_sglang_src,
    check_spins_device,
    get_tree_argument,
    parse_duration,
    parse_spins,
    read_trace_file,
)
from hicache_ref.campaign.cli_lists import add_list_command
from hicache_ref.campaign.cli_mutants import add_mutants_command
from hicache_ref.campaign.gate import (
    KNOWN_NONE,
    gate_json,
    get_exit_status,
    get_gate_known,
    render_gate,
)
from hicache_ref.campaign.interrupts import EXIT_INTERRUPTED, Interrupt, catching_stop_signals
from hicache_ref.campaign.interrupts import get_exit_status as get_signal_exit_status
from hicache_ref.campaign.pp_share import gate_pp_share, get_pp_share, replay_program
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.run import run_campaign
from hicache_ref.campaign.summary import render_summary, render_verdict
from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError
from hicache_ref.fleet.commands import (
    add_fleet_arguments,
    add_report_command,
    add_traces_command,
    plan_from_args,
)
from hicache_ref.fleet.progress import ProgressView
from hicache_ref.fleet.workers import run_fleet
from hicache_ref.harness.adapters.base import unsupported_reasons
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.registry import checked_implementation
from hicache_ref.harness.adapters.sglang_tree import recorded_tree
from hicache_ref.harness.campaigns.known_findings import (
    ALL,
    KNOWN_FINDINGS,
    KnownFinding,
)
from hicache_ref.harness.campaigns.pp_program_file import is_program_file
from hicache_ref.harness.campaigns.profiles import PROFILES, get_profile_help
from hicache_ref.harness.steps.replay import minimize, replay
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.world import DEVICE_KINDS
from hicache_ref.vectors.cli import add_vectors_parser

__all__ = ["CampaignReport", "main", "run_campaign"]  # run_campaign: for older imports

PROG = "hicache-fuzz"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
RUN_BUDGET_DEFAULT, GATE_BUDGET_DEFAULT = "60s", "120s"


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
        if args.workers is not None or args.database or args.max_cases is not None:
            raise HiCacheInputError(
                "--workers, --database and --max-cases are for single-process worlds; "
                "--cp-processes spawns one process per rank itself: drop one of them"
            )
        return run_cp_command(args)
    report = _campaign(args, _campaign_inputs(args), known=())
    print(render_summary(report, verdict=False))
    _write_json(args, report.as_json())
    print(render_verdict(report))  # the last line
    return get_exit_status(report)


def cmd_gate(args: argparse.Namespace) -> int:
    """A campaign that counts known findings, and fails only on a new failure."""
    if args.matrix:  # every release of a range, one table (hicache_ref/campaign/matrix.py)
        from hicache_ref.campaign.matrix import cmd_matrix

        return cmd_matrix(args)
    known = get_gate_known(args.known, args.impl)
    inputs = _campaign_inputs(args)
    share = get_pp_share(inputs.implementation.capabilities)  # storage:pp: the PP gate's share
    cases, _ = split_cases(args.max_cases, share)  # of the time and of --max-cases alike
    report = _campaign(args, inputs, known=known, seconds=args.budget * (1 - share), cases=cases)
    pp = gate_pp_share(
        report,
        inputs.implementation,
        impl=args.impl,
        budget_s=args.budget,
        seed=args.seed + args.shard.index - 1,  # each runner of a --shard fleet its own programs
        out_dir=inputs.out_dir,
        keep_going=args.keep_going,
        known=known,
        cases_max=args.max_cases,
    )
    print(render_summary(report, replay_lines=False, verdict=False))
    if pp is not None:
        print(pp.render())
    gate_lines = render_gate(report, known)
    if gate_lines:
        print(gate_lines)
    pp_json = {"pp_gate": pp.as_json() if pp is not None else None}
    _write_json(args, {**report.as_json(), "gate": gate_json(report, known), **pp_json})
    print(render_verdict(report, prog="gate", pp=pp))  # the last line
    return get_exit_status(report)


@dataclass(frozen=True)
class CampaignInputs:
    """A campaign's command line, checked: the implementation after the contract's preflight
    (a break is exit 2), the --out folder, the tree it names and the --spins it takes."""

    implementation: ImplementationBase
    out_dir: Path
    source: str
    perturbation: Perturbation | None


def _campaign_inputs(args: argparse.Namespace) -> CampaignInputs:
    """Every input checked, a bad one one line before any work."""
    out_dir = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    source = get_tree_argument(args)
    perturbation = check_spins_device("--spins", args.spins, args.device)
    implementation = checked_implementation(args.impl, source)
    return CampaignInputs(implementation, out_dir, source, perturbation)


def _campaign(
    args: argparse.Namespace,
    inputs: CampaignInputs,
    *,
    known: tuple[KnownFinding, ...],
    seconds: float | None = None,
    cases: int | None = None,
) -> CampaignReport:
    """Run the workers for ``seconds`` (default: --budget) or ``cases`` (--max-cases) each."""
    budget = args.budget if seconds is None else seconds
    tasks = plan_from_args(
        args,
        out_dir=inputs.out_dir,
        known=known,
        perturbation=inputs.perturbation,
        source=inputs.source,
        seconds=budget,
        cases_max=cases,
    )
    if len(tasks) > 1:  # what a worker would find out after starting, found out once, here
        if args.device == "cuda":
            from hicache_ref.device.cuda import require_cuda

            require_cuda()
    view = None if args.no_progress else ProgressView(budget, workers=len(tasks))
    if view is not None:
        view.say(
            f"{PROG}: fuzzing {args.impl} for {budget:g}s on {len(tasks)} worker(s), "
            f"seeds from {args.seed}, shard {args.shard.label}; Ctrl-C stops and reports"
        )
    try:
        return run_fleet(tasks, view, interrupt=getattr(args, "interrupt", None))
    except BaseException as exc:
        interrupt = getattr(args, "interrupt", None)
        if not isinstance(exc, KeyboardInterrupt) and not (interrupt and interrupt.is_set()):
            raise
        # before a campaign could take it (or, cut in half by it, its setup failed): nothing
        # ran, say so
        nothing = CampaignReport(args.impl, args.profile, args.seed, device=args.device)
        nothing.interrupted = True
        return nothing
    finally:
        if view is not None:
            view.close()


def _write_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Write the report; the path was checked writable before the work, so a failure here (a
    full disk) is one line on stderr and the verdict's exit status stands."""
    if not args.json:
        return
    try:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        print(f"{PROG}: error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
        return
    print(f"  report: {args.json}")


# -- traces ----------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    if is_program_file(args.trace):  # a PP gate's failing program (pp_share.py), not a trace
        if args.device not in (None, "sim"):
            raise HiCacheInputError(
                f"PP program {args.trace} replays on the simulated device; drop --device"
            )
        return replay_program(args.trace, impl=args.impl, sglang_src=args.sglang_src)
    trace, source = _trace_for(args)
    if trace.header.cp_processes:  # recorded across processes: spawn them again
        from hicache_ref.distributed.commands import replay_cp_command

        return replay_cp_command(args, trace, Path(args.trace))
    result = replay(trace, implementation=args.impl, device=args.device, source=source)
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
    trace, source = _trace_for(args)
    if trace.header.cp_processes:  # ddmin replays in one process: it would judge another world
        raise HiCacheInputError(
            f"trace {args.trace} was recorded across {trace.header.cp_processes} processes and "
            "minimize replays in one; replay it with hicache-fuzz replay instead"
        )
    if not replay(trace, implementation=args.impl, device=args.device, source=source).failed:
        name = args.impl or trace.header.implementation
        raise HiCacheInputError(
            f"trace {args.trace} does not fail on {name}: it passes every step and the "
            "quiescence checks, so there is nothing to minimize (check --impl, or replay it)"
        )
    small = minimize(trace, implementation=args.impl, device=args.device, source=source)
    path = small.write(output)
    print(f"minimized {len(trace.steps)} -> {len(small.steps)} steps: {path}")
    return EXIT_OK


def _trace_for(args: argparse.Namespace) -> tuple[Trace, str]:
    """The trace, checked to replay on its implementation (or --impl) before any step runs, and
    the tree ``--sglang-src`` names instead of the recorded one (empty: none)."""
    trace = read_trace_file(args.trace)
    name = args.impl or trace.header.implementation
    override = ""
    if args.sglang_src:
        if name not in TREE_IMPLEMENTATIONS:
            raise HiCacheInputError(
                f"--sglang-src names an sglang tree, but trace {args.trace} replays on "
                f"{name!r}, which reads none: add --impl sglang (or seed), or drop the flag"
            )
        override = str(check_sglang_src(args.sglang_src))
    recorded = trace.header.source if name == trace.header.implementation else ""
    source = override or recorded_tree(recorded)
    implementation = checked_implementation(name, source)  # the trace's own tree, checked
    reasons = unsupported_reasons(implementation.capabilities, trace.header.config)
    if reasons:
        raise HiCacheInputError(
            f"implementation {name!r} cannot replay trace {args.trace} "
            f"({trace.header.config.describe()}): it lacks {reasons}; pick another --impl"
        )
    return trace, override


# -- the command line ------------------------------------------------------------------------
def cmd_setup(args: argparse.Namespace) -> int:
    """Fetch the sglang tree the gate reads (once; cached), and build fork trees asked for."""
    from hicache_ref.harness.adapters.sglang_releases import fetch_release_tree, install_release
    from hicache_ref.harness.adapters.sglang_tree import SGLANG_VERSION, fork_tree

    for given in args.sources or []:  # no network: a wheel or a tree into the cache
        version, installed = install_release(Path(given))
        print(f"sglang {version}: {installed}  (from {given}; --sglang-version {version} reads it)")
    if args.sources and not args.version and not args.seed:
        return EXIT_OK
    tree = fetch_release_tree(args.version or SGLANG_VERSION)
    print(f"sglang {args.version or SGLANG_VERSION}: {tree}")
    for controller in args.seed or []:
        fork = fork_tree(Path(controller), base=tree)
        print(f"fork tree of {controller}: {fork}  (--impl seed --sglang-src {fork})")
    return EXIT_OK


def _add_campaign_arguments(parser: argparse.ArgumentParser, budget_default: str) -> None:
    parser.add_argument(
        "--impl",
        default="reference",
        help="the implementation under test: reference | sglang | seed | mutant:<name> | an "
        "entry point of the hicache_ref.implementations group | pkg.module:factory "
        "(default reference)",
    )
    parser.add_argument(
        "--sglang-src",
        metavar="DIR",
        help="an unpacked sglang tree (holds sglang/srt/managers/cache_controller.py) for "
        "--impl sglang / seed (required with this flag: without it, exit 2)",
    )
    parser.add_argument(
        "--sglang-version",
        metavar="X",
        help="an upstream release (0.5.17, 0.5.15.post1) for --impl sglang (required with this "
        "flag): its wheel is fetched once into the cache (or taken from hicache-fuzz setup "
        "--from) and gated like --sglang-src",
    )
    add_budget_argument(parser, budget_default, what="per worker")
    add_cases_argument(parser)
    parser.add_argument(
        "--profile",
        default="ci",
        choices=sorted(PROFILES),
        help=get_profile_help(),
    )
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
        "--seed",
        type=int,
        default=0,
        help="the seed space starts here; one worker on one runner runs seed + k in round k "
        "(default 0; see --workers and --shard for how they split it)",
    )
    parser.add_argument(
        "--out",
        default="fuzz/out",
        help="where failing traces are written (default fuzz/out; names carry the "
        "implementation, seed and a digest of the trace, so runs never overwrite each other)",
    )
    parser.add_argument("--json", metavar="FILE", help="write a machine-readable report here")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (by default: a bar on a terminal, a line every 30 s in a log)",
    )
    parser.add_argument(
        "--hypothesis-shrink",
        action="store_true",
        help="also let Hypothesis shrink failures (can take minutes; ddmin always runs after)",
    )
    add_fleet_arguments(parser)


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSONL trace (fuzz/out/failure-*.jsonl, fuzz/corpus/)")
    parser.add_argument(
        "--impl",
        default=None,
        help="override the trace's implementation (a name, or pkg.module:factory)",
    )
    parser.add_argument(
        "--sglang-src",
        metavar="DIR",
        help="as for run: read this sglang tree instead of the one the trace recorded",
    )
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
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {__version__} ({Path(__file__).parent})"
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run a fuzz campaign and print a summary")
    _add_campaign_arguments(run, RUN_BUDGET_DEFAULT)
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
    _add_campaign_arguments(gate, GATE_BUDGET_DEFAULT)
    gate.add_argument(
        "--known",
        nargs="+",
        default=None,
        metavar="ID",
        help="known-finding ids to count instead of failing on; default: every finding written "
        f"up for --impl (as '{ALL}'); '{KNOWN_NONE}' fails on every failure "
        f"(registered: {', '.join(sorted(KNOWN_FINDINGS)) or 'none'})",
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
        "one table; --known defaults to all (hicache_ref/campaign/matrix.py)",
    )
    gate.add_argument(
        "--budget-each",
        type=parse_duration,
        default=None,
        help="with --matrix: how long to fuzz each release (default 60s)",
    )
    gate.set_defaults(func=cmd_gate)
    rep = sub.add_parser(
        "replay", help="replay a trace (or a PP gate's program file) without Hypothesis"
    )
    _add_trace_arguments(rep)
    rep.set_defaults(func=cmd_replay)
    mini = sub.add_parser("minimize", help="delta-debug a failing trace to fewer steps")
    _add_trace_arguments(mini)
    mini.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="TRACE",
        help="where to write the minimized trace (a .jsonl file; its folder must exist)",
    )
    mini.set_defaults(func=cmd_minimize)
    add_mutants_command(sub)
    add_list_command(sub)
    add_report_command(sub)
    add_traces_command(sub)
    add_vectors_parser(sub)
    setup = sub.add_parser(
        "setup",
        help="fetch the sglang wheel the gate reads (cached), or take one from a file (--from)",
    )
    setup.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        metavar="FILE_OR_DIR",
        help="put an sglang wheel (sglang-X-py3-none-any.whl) or an unpacked tree of any "
        "release into the cache, with no network: every command, test and benchmark that needs "
        "that release reads it from there (an air-gapped GPU runner)",
    )
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


TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def _with_default_command(argv: list[str], commands: set[str]) -> list[str]:
    """``hicache-fuzz`` and ``hicache-fuzz --seconds 5`` mean ``hicache-fuzz run ...``."""
    if not argv or (argv[0].startswith("-") and argv[0] not in TOP_LEVEL_FLAGS):
        return ["run", *argv]
    if argv[0] not in commands and argv[0] not in TOP_LEVEL_FLAGS:
        raise UsageError(
            f"unknown command {argv[0]!r}{_did_you_mean(argv[0], commands)}; commands: "
            f"{', '.join(sorted(commands))}; see {PROG} --help"
        )
    return argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    commands = set(_subparsers(parser))
    args, extra = parser.parse_known_args(_with_default_command(argv, commands))
    if extra:  # name the subcommand whose help lists the legal flags, and the nearest flag
        command = _subparsers(parser)[args.command]
        flags = {s for action in command._actions for s in action.option_strings}
        hints = "".join(
            _did_you_mean(word.split("=")[0], flags) for word in extra if word.startswith("-")
        )
        command.error(f"unrecognized arguments: {' '.join(extra)}{hints}")
    return args


def _did_you_mean(word: str, legal: set[str]) -> str:
    """`` (did you mean 'gate'?)`` for a near miss, else empty."""
    close = difflib.get_close_matches(word, sorted(legal), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            choices: dict[str, argparse.ArgumentParser] = action.choices
            return choices
    return {}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a bad input or setup is one line on stderr and exit status 2."""
    interrupt = Interrupt()
    try:
        with catching_stop_signals(interrupt):  # SIGINT and SIGTERM end a campaign with a report
            args = parse_args(sys.argv[1:] if argv is None else list(argv))
            args.interrupt = interrupt
            func: Callable[[argparse.Namespace], int] = args.func
            status = int(func(args))
    except HiCacheInputError as exc:  # a HiCacheSetupError too; any other error is a bug
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a campaign's rounds (they report what ran themselves)
        print(f"{PROG}: interrupted before any campaign ran", file=sys.stderr)
        return get_signal_exit_status(interrupt)
    if status == EXIT_INTERRUPTED:  # 143 when it was SIGTERM
        return get_signal_exit_status(interrupt)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
