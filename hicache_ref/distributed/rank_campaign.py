"""One rank's campaign: rank 0 picks each case (or the trace to replay) and broadcasts it;
every rank drives it (``driver.drive_case``) and adds what it did to its ``RankReport``.

Rank 0 alone decides when the campaign ends (time is up, a failure and no ``keep_going``, or
``cases_max``) and says so by broadcasting no case, so every rank leaves the loop together.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from hicache_ref.distributed.driver import CaseSpec, ProgramSource, TraceSource, drive_case
from hicache_ref.distributed.group import RankGroup
from hicache_ref.distributed.reports import Failure, RankReport, WorldSpec
from hicache_ref.distributed.schedule import draw_cp_config
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.world import HarnessDevice, gpu_config


def run_rank(group: RankGroup, spec: WorldSpec, report: RankReport) -> None:
    implementation = get_implementation(spec.impl, spec.source)
    device = _device(group)
    trace = Trace.read(Path(spec.trace)) if spec.trace else None
    rng = random.Random(spec.seed)
    start = time.monotonic()
    bar = _progress_bar(spec) if group.rank == 0 else None
    try:
        while True:
            case = _next_case(group, spec, implementation.capabilities, rng, start, report, trace)
            if case is None:
                break
            source = None
            if group.rank == 0:
                source = (
                    TraceSource(trace.steps)
                    if trace is not None
                    else ProgramSource(
                        case.program_seed, case.steps_max, probes=spec.backend != "nccl"
                    )
                )
            result = drive_case(group, case, implementation, spec.impl, source, device=device)
            report.cases += 1
            report.steps += result.steps
            report.skipped += result.skipped
            report.left_out += result.left_out
            report.absorb(result.rules, result.checks_by_id, case.config.describe())
            if result.verdict is not None:
                report.failures.append(
                    Failure(
                        result.verdict.signature,
                        result.verdict.line,
                        result.trace,
                        case.index,
                        case.config.describe(),
                    )
                )
            if bar is not None:
                bar.n = min(spec.seconds, round(time.monotonic() - start, 1))
                bar.set_postfix(
                    cases=report.cases, steps=report.steps, failures=len(report.failures)
                )
                bar.refresh()
    finally:
        if bar is not None:
            bar.close()


def _next_case(
    group: RankGroup,
    spec: WorldSpec,
    capabilities: frozenset[str],
    rng: random.Random,
    start: float,
    report: RankReport,
    trace: Trace | None,
) -> CaseSpec | None:
    """Rank 0's next case (None: the campaign is over), broadcast to every rank."""
    case: CaseSpec | None = None
    if group.rank == 0:
        case = _pick_case(spec, capabilities, rng, start, report, trace)
    return group.broadcast(case)


def _pick_case(
    spec: WorldSpec,
    capabilities: frozenset[str],
    rng: random.Random,
    start: float,
    report: RankReport,
    trace: Trace | None,
) -> CaseSpec | None:
    if trace is not None:
        if report.cases:
            return None
        return CaseSpec(0, trace.header.config, 0, len(trace.steps), "")
    if report.failures and not spec.keep_going:
        return None
    if spec.cases_max and report.cases >= spec.cases_max:
        return None
    if report.cases and time.monotonic() - start >= spec.seconds:
        return None
    config = draw_cp_config(rng, spec.processes, capabilities)
    if config is None:
        return None
    if spec.backend == "nccl":  # what a GPU world must say (no misuse probes are drawn either)
        config = gpu_config(config)
    index = report.cases
    seed = spec.seed * 1_000_003 + index
    stamp = f"{spec.impl.replace(':', '-')}-cp{spec.processes}-seed{spec.seed}-case{index}"
    path = str(Path(spec.out_dir) / f"failure-{stamp}.jsonl")
    return CaseSpec(index, config, seed, spec.steps_per_case, path)


def _device(group: RankGroup) -> HarnessDevice | None:
    """None: the world builds its seeded SimDevice; on NCCL, this rank's GPU."""
    if group.backend != "nccl":
        return None
    from hicache_ref.distributed.cuda_device import CudaRankDevice

    return CudaRankDevice(group.rank)


def _progress_bar(spec: WorldSpec) -> Any:
    if not spec.progress or spec.trace:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=spec.seconds,
        unit="s",
        desc=f"fuzzing cp x{spec.processes} {spec.backend}",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}",
    )
