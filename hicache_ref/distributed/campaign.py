"""The parent's side: a CP campaign or a replay across processes, and the one report of it.

``run_cp_campaign`` spawns the world once (``launcher.spawn_world``) and lets it run cases
until the time is up; ``replay_cp_trace`` spawns as many ranks as the trace's header recorded
and replays its steps. Both check that every rank reported the same failures (the same
one-line message and replay line); a rank that reported none, or something else, is named.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_ref.distributed.driver import backend_of
from hicache_ref.distributed.group import Backend
from hicache_ref.distributed.launcher import spawn_world
from hicache_ref.distributed.reports import Failure, RankReport, WorldSpec
from hicache_ref.harness.adapters.sglang_tree import recorded_tree
from hicache_ref.harness.steps.trace import Trace


@dataclass(frozen=True)
class CpReport:
    """What a CP world across processes did, from every rank's report."""

    impl: str
    processes: int
    backend: str
    seed: int
    seconds: float
    ranks: tuple[RankReport, ...]

    @property
    def lead(self) -> RankReport:
        return self.ranks[0]

    @property
    def failures(self) -> list[Failure]:
        return self.lead.failures

    @property
    def rank_errors(self) -> list[str]:
        """Ranks that could not take part, or that disagree with rank 0 on the failures."""
        problems = [f"rank {r.rank}: {r.error}" for r in self.ranks if r.error]
        lead = [(f.message, f.trace) for f in self.lead.failures]
        for report in self.ranks[1:]:
            theirs = [(f.message, f.trace) for f in report.failures]
            if not report.error and theirs != lead:
                problems.append(f"rank {report.rank} reported {theirs} but rank 0 {lead}")
        return problems

    @property
    def failed(self) -> bool:
        return bool(self.failures or self.rank_errors)

    def replay_lines(self) -> list[str]:
        return [f"hicache-fuzz replay {f.trace}" for f in self.failures if f.trace]

    def render(self) -> str:
        lead = self.lead
        rate = lead.steps / max(lead.seconds, 1e-9)
        lines = [
            f"hicache-fuzz: {self.impl}, CP across {self.processes} processes ({self.backend}), "
            f"seed {self.seed}",
            f"  {lead.cases} cases, {lead.steps} steps ({lead.skipped} skipped, {lead.left_out} "
            f"left out: not enabled on every rank) in {self.seconds:.1f}s ({lead.seconds:.1f}s "
            f"in the ranks) = {rate:.0f} steps/s per rank; "
            f"{len(lead.configs)} distinct configs",
            "  rules hit: " + ", ".join(f"{k}={v}" for k, v in sorted(lead.rules.items())),
            "  checks by invariant (rank 0): "
            + ", ".join(f"{k}={v}" for k, v in sorted(lead.checks_by_id.items())),
        ]
        if self.failures:
            lines.append(f"  FAILURES: {len(self.failures)} (the same on every rank)")
            for failure in self.failures:
                lines.append(f"    {failure.message}")
                if failure.trace:
                    lines.append(f"    replay: hicache-fuzz replay {failure.trace}")
                else:  # it failed outside a step (world setup): the seed rebuilds it
                    lines.append(
                        f"    no trace; rerun: hicache-fuzz run --impl {self.impl} --cp-processes "
                        f"{self.processes} --backend {self.backend} --seed {self.seed}"
                    )
        else:
            lines.append("  failures: none")
        lines += [f"  RANK PROBLEM: {problem}" for problem in self.rank_errors]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        lead = self.lead
        return {
            "implementation": self.impl,
            "cp_processes": self.processes,
            "backend": self.backend,
            "seed": self.seed,
            "seconds": round(self.seconds, 2),
            "cases": lead.cases,
            "steps": lead.steps,
            "skipped_steps": lead.skipped,
            "left_out_steps": lead.left_out,
            "rules": dict(sorted(lead.rules.items())),
            "checks_by_id": dict(sorted(lead.checks_by_id.items())),
            "distinct_configs": len(lead.configs),
            "failures": [
                {**f.__dict__, "invariant": f.signature, "error": f.message} for f in self.failures
            ],
            "rank_problems": self.rank_errors,
            "ranks": [r.to_json() for r in self.ranks],
        }


def run_cp_campaign(
    impl: str,
    *,
    processes: int,
    backend: Backend = "gloo",
    seconds: float,
    seed: int = 0,
    out_dir: Path = Path("fuzz/out"),
    steps_per_case: int = 80,
    cases_max: int = 0,
    keep_going: bool = False,
    progress: bool = True,
    source: str = "",
    collective_timeout_s: float = 60.0,
    deadline_s: float = 0.0,
) -> CpReport:
    """Cases of a CP world of ``processes`` ranks, one per process, until ``seconds`` pass
    (``deadline_s``: when the parent kills what still runs; 0 picks one from the timeouts)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = WorldSpec(
        impl=impl,
        processes=processes,
        backend=backend,
        seed=seed,
        seconds=seconds,
        out_dir=str(out_dir),
        steps_per_case=steps_per_case,
        cases_max=cases_max,
        keep_going=keep_going,
        progress=progress,
        source=source,
        collective_timeout_s=collective_timeout_s,
        deadline_s=deadline_s,
    )
    return _run(spec)


def replay_cp_trace(
    trace_path: Path,
    *,
    impl: str | None = None,
    backend: Backend | None = None,
    collective_timeout_s: float = 60.0,
) -> CpReport:
    """Replay a trace recorded across processes on as many processes as it recorded."""
    trace = Trace.read(trace_path)
    assert trace.header.cp_processes >= 2, f"{trace_path} was not recorded across processes"
    name = impl or trace.header.implementation
    chosen: Backend = backend or ("nccl" if backend_of(trace) == "nccl" else "gloo")
    spec = WorldSpec(
        impl=name,
        processes=trace.header.cp_processes,
        backend=chosen,
        trace=str(trace_path),
        source=recorded_tree(trace.header.source if name == trace.header.implementation else ""),
        collective_timeout_s=collective_timeout_s,
        seconds=collective_timeout_s,
    )
    return _run(spec)


def _run(spec: WorldSpec) -> CpReport:
    start = time.monotonic()
    ranks = spawn_world(spec)
    return CpReport(
        spec.impl, spec.processes, spec.backend, spec.seed, time.monotonic() - start, tuple(ranks)
    )
