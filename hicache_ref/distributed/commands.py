"""``hicache-fuzz run --cp-processes N`` and the replay of a trace recorded across processes.

The CLI hands over here once it sees ``--cp-processes`` (or a trace header's
``cp_processes``): inputs are checked first (``cli_inputs``: each bad one is one line, exit 2),
then the world is spawned, and the summary says cases, steps, failures and their replay lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hicache_ref.campaign.cli_inputs import (
    check_cp_backend,
    check_cp_implementation,
    check_cp_processes,
    check_out_dir,
    check_output_file,
    get_tree_argument,
)
from hicache_ref.distributed.campaign import replay_cp_trace, run_cp_campaign
from hicache_ref.distributed.group import Backend
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.steps.trace import Trace

EXIT_OK, EXIT_FAILED = 0, 1


def run_cp_command(args: argparse.Namespace) -> int:
    """The campaign of ``run --cp-processes N``: every input checked, then one spawned world."""
    processes = check_cp_processes("--cp-processes", int(args.cp_processes))
    backend = _backend(check_cp_backend("--backend", args.backend, processes))
    if getattr(args, "device", "sim") == "cuda" and backend != "nccl":
        raise HiCacheInputError(
            "--device cuda with --cp-processes: the backend picks the device (gloo: SimDevice, "
            "nccl: one GPU per rank); pass --backend nccl for GPUs"
        )
    out_dir = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    source = get_tree_argument(args)
    capabilities = get_implementation(args.impl, source).capabilities
    check_cp_implementation("--cp-processes", args.impl, capabilities)
    report = run_cp_campaign(
        args.impl,
        processes=processes,
        backend=backend,
        seconds=float(args.budget),
        seed=int(args.seed),
        out_dir=out_dir,
        keep_going=bool(args.keep_going),
        progress=not args.no_progress,
        source=source,
    )
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        print(f"  report: {args.json}")
    return EXIT_FAILED if report.failed else EXIT_OK


def replay_cp_command(args: argparse.Namespace, trace: Trace, trace_path: Path) -> int:
    """Replay a trace on as many processes as recorded it; the verdict is every rank's."""
    processes = check_cp_processes("the trace's cp_processes", trace.header.cp_processes)
    backend_flag = getattr(args, "backend", None)
    backend = None if backend_flag is None else _backend(backend_flag)
    if backend is not None:
        check_cp_backend("--backend", backend, processes)
    report = replay_cp_trace(trace_path, impl=args.impl, backend=backend)
    lead = report.lead
    if report.failures:
        print(f"FAILED on {processes} processes ({report.backend}): {report.failures[0].message}")
    elif report.rank_errors:
        print(f"FAILED on {processes} processes: {report.rank_errors[0]}")
    else:
        print(
            f"passed on {processes} processes ({report.backend}): {lead.steps} step(s) and the "
            f"quiescence checks ({trace.header.config.describe()})"
        )
    for problem in report.rank_errors:
        print(f"  RANK PROBLEM: {problem}")
    return EXIT_FAILED if report.failed else EXIT_OK


def _backend(name: str) -> Backend:
    return "nccl" if name == "nccl" else "gloo"
