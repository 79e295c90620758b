"""Spawn a CP world, one process per rank, and collect what each rank reports.

``spawn_world`` -> ``torch.multiprocessing`` spawns ``processes`` fresh interpreters (never a
fork of a process holding torch threads) -> each runs ``rank_main``: join the group, run the
campaign or the replay its ``WorldSpec`` asks for, write a ``RankReport`` (JSON) into the
parent's folder -> the parent waits until ``deadline_s`` (or, once a rank has ended, one
collective timeout more), kills (by pid) every child still alive, and returns one report per
rank, a missing one standing for a rank that died or hung.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import start_processes

from hicache_ref.distributed.group import apply_process_env, open_group
from hicache_ref.distributed.rank_campaign import run_rank
from hicache_ref.distributed.reports import RankReport, WorldSpec

JOIN_POLL_S = 0.2


def rank_main(rank: int, spec: WorldSpec, folder: str) -> None:
    """A child's entry point: it always writes its report, whatever happens."""
    apply_process_env()
    torch.set_num_threads(1)
    report = RankReport(rank)
    start = time.monotonic()
    group = None
    try:
        group = open_group(
            spec.backend,
            rank,
            spec.processes,
            Path(folder) / "store",
            spec.collective_timeout_s,
        )
        run_rank(group, spec, report)
    except Exception as exc:  # a collective timed out or a peer died: say so, then leave
        report.error = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    finally:
        report.seconds = time.monotonic() - start
        path = Path(folder) / f"rank{rank}.json"
        path.write_text(json.dumps(report.to_json()))
        if group is not None:
            try:
                group.close()
            except Exception:  # a broken group cannot always be torn down; the process ends
                pass


def spawn_world(spec: WorldSpec) -> list[RankReport]:
    """Run ``spec`` on ``spec.processes`` ranks; one report per rank, in rank order."""
    assert spec.processes >= 2, f"a CP world across processes needs 2+ ranks, got {spec.processes}"
    apply_process_env()
    deadline_s = spec.deadline_s or (spec.seconds + 2 * spec.collective_timeout_s + 60.0)
    with tempfile.TemporaryDirectory(prefix="hicache-cp-") as folder:
        context = start_processes(  # type: ignore[no-untyped-call]
            rank_main,
            args=(spec, folder),
            nprocs=spec.processes,
            join=False,
            start_method="spawn",
        )
        _join_or_kill(context, time.monotonic() + deadline_s, spec.collective_timeout_s + 5.0)
        return [_read_report(Path(folder), rank, deadline_s) for rank in range(spec.processes)]


def _join_or_kill(context: Any, deadline: float, grace_s: float) -> None:
    """Wait for every child; kill the rest at the deadline, or ``grace_s`` after the first one
    ended while others did not (they outlived every collective timeout: they hang)."""
    first_exit: float | None = None
    try:
        while not context.join(timeout=JOIN_POLL_S):
            now = time.monotonic()
            if first_exit is None and any(not p.is_alive() for p in context.processes):
                first_exit = now
            if now > deadline or (first_exit is not None and now - first_exit > grace_s):
                break
    except Exception:  # a child died without its report: the missing report says so
        pass
    for process in context.processes:
        if process.is_alive():
            process.kill()  # by its pid: only the processes this call started
            process.join(timeout=5.0)


def _read_report(folder: Path, rank: int, deadline_s: float) -> RankReport:
    path = folder / f"rank{rank}.json"
    if not path.is_file():
        return RankReport(
            rank, error=f"rank {rank} sent no report within {deadline_s:.0f}s (killed or crashed)"
        )
    return RankReport.from_json(json.loads(path.read_text()))
