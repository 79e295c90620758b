"""The fleet's part of the command line: ``--workers``, ``--shard``, ``--database``,
``--coverage``, ``--report-live``/``--report-every``, and the ``report`` and ``traces``
subcommands.

``add_fleet_arguments`` adds those options to ``run`` and ``gate``; ``plan_from_args``
checks them (a database is reached once before any work) and turns a parsed command line into
the workers' tasks. ``report`` renders the page of ``fleet/report.py``; ``traces`` writes the
failure traces a database holds into a folder, one file per trace, named by its digest (the
same name on every runner that pulls it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hicache_ref.campaign.cli_inputs import check_out_dir, check_output_file
from hicache_ref.campaign.failures import get_trace_stem
from hicache_ref.errors import HiCacheInputError
from hicache_ref.fleet.database import DatabaseSpec, check_database, parse_database
from hicache_ref.fleet.shards import Shard, parse_shard
from hicache_ref.fleet.workers import WorkerTask, get_default_workers, plan_workers
from hicache_ref.replay_lines import get_replay_line

EXIT_OK = 0


def parse_workers(text: str) -> int:
    """``--workers N``: a positive process count."""
    try:
        workers = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes") from None
    if workers < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive; give 1 or more processes")
    return workers


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """``--workers``, ``--shard`` and ``--database`` (``run`` and ``gate``)."""
    parser.add_argument(
        "--workers",
        type=parse_workers,
        default=None,
        metavar="N",
        help="worker processes, each a campaign on its own seeds, merged into one report "
        f"(default: this machine's cores, {get_default_workers()}; 1 runs in this process). "
        "With --device cuda the workers share the GPU, each with its own streams",
    )
    parser.add_argument(
        "--shard",
        type=parse_shard,
        default=Shard(),
        metavar="I/N",
        help="this runner is I of N (1-based, as a CI matrix numbers jobs): it takes the seeds "
        "seed + I - 1 modulo N, disjoint from the other runners' (default 1/1)",
    )
    parser.add_argument(
        "--database",
        metavar="URL",
        help="a failure database shared by every worker and runner (Hypothesis' own): a "
        "folder, redis://host:port, or local+redis://host:port (read the fleet's, write "
        "locally); the first round replays what any campaign saved there",
    )
    parser.add_argument(
        "--report-live",
        metavar="HTML",
        help="write the report page (as hicache-fuzz report draws it) while the campaign runs, "
        "rewritten every --report-every seconds; a browser reloads it as often",
    )
    parser.add_argument(
        "--report-every",
        type=float,
        default=10.0,
        metavar="S",
        help="with --report-live: seconds between rewrites of the page (default 10)",
    )
    parser.add_argument(
        "--coverage",
        action="store_true",
        help="measure line and branch coverage of the implementation's own code over time, per "
        "worker, into --json and the report (needs the fleet extra; costs steps/s, see "
        "benchmarks/RESULTS.md)",
    )


def plan_from_args(
    args: argparse.Namespace,
    *,
    out_dir: Path,
    known: tuple[Any, ...],
    perturbation: Any,
    source: str = "",
    seconds: float | None = None,
    cases_max: int | None = None,
) -> list[WorkerTask]:
    """The workers' tasks for a ``run``/``gate`` command line (inputs checked already;
    ``source``: the sglang tree it named; ``seconds``: each worker's, default --budget;
    ``cases_max``: each worker's case budget, default --max-cases)."""
    database = _checked_database(args.database) if args.database else None
    return plan_workers(
        args.impl,
        seed=args.seed,
        shard=args.shard,
        workers=args.workers or get_default_workers(),
        seconds=args.budget if seconds is None else seconds,
        cases_max=getattr(args, "max_cases", None) if cases_max is None else cases_max,
        profile=args.profile,
        out_dir=str(out_dir),
        stop_on_failure=not args.keep_going,
        shrink=args.hypothesis_shrink,
        known=known,
        device=args.device,
        perturbation=perturbation,
        database=database,
        source=source,
        coverage=bool(getattr(args, "coverage", False)),
        **_live_report(args),
    )


def _live_report(args: argparse.Namespace) -> dict[str, Any]:
    """``--report-live HTML --report-every S``: the tasks' live page, its path checked now."""
    path = getattr(args, "report_live", None)
    if not path:
        return {}
    every_s = float(args.report_every)
    if not every_s > 0:
        raise HiCacheInputError(
            f"--report-every must be a positive number of seconds, got {every_s:g}"
        )
    return {"live_report": str(check_output_file("--report-live", path)), "report_every_s": every_s}


def _checked_database(text: str) -> DatabaseSpec:
    return check_database(parse_database(text))


# -- hicache-fuzz report ---------------------------------------------------------------------
def add_report_command(sub: Any) -> None:
    report = sub.add_parser(
        "report", help="render the JSON reports of run/gate --json as one HTML page"
    )
    report.add_argument(
        "reports",
        nargs="+",
        metavar="RUN.json",
        help="reports of run/gate --json: one per runner (a fleet's file holds its workers)",
    )
    report.add_argument(
        "-o", "--output", required=True, metavar="HTML", help="the page to write (one file)"
    )
    report.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    output = check_output_file("-o/--output", args.output)
    paths = [Path(text) for text in args.reports]
    for path in paths:
        if not path.is_file():
            raise HiCacheInputError(
                f"report {path} does not exist; pass the files run/gate --json wrote"
            )
    from hicache_ref.fleet.report import write_report

    merged = write_report(paths, output)
    print(
        f"report: {output} ({len(paths)} file(s), {merged.workers} worker(s), {merged.cases} "
        f"cases, {len(merged.failures)} failure(s))"
    )
    return EXIT_OK


# -- hicache-fuzz traces ---------------------------------------------------------------------
def add_traces_command(sub: Any) -> None:
    traces = sub.add_parser("traces", help="write the failure traces a --database holds")
    traces.add_argument(
        "--database", required=True, metavar="URL", help="as for run: a folder or redis://..."
    )
    traces.add_argument("--impl", default=None, help="only this implementation's traces")
    traces.add_argument(
        "-o", "--out", default="fuzz/out", help="the folder to write them to (default fuzz/out)"
    )
    traces.set_defaults(func=cmd_traces)


def cmd_traces(args: argparse.Namespace) -> int:
    out_dir = check_out_dir("-o/--out", args.out)
    database = _checked_database(args.database).open()
    traces = database.load_traces(args.impl)
    for trace in traces:
        path = trace.write(out_dir / f"{get_trace_stem(trace)}.jsonl")
        print(
            f"{trace.header.implementation}: {len(trace.steps)} steps: {get_replay_line(path, trace.header.implementation)}"
        )
    print(f"traces: {len(traces)} from {database.label} in {out_dir}")
    return EXIT_OK
