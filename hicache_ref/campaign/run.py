"""Fuzz campaigns: rounds of the state machine against one implementation, until the time is up.

``run_campaign`` runs seeded rounds (``rounds.py``) until the time is up (round k uses
``seed + k * seed_stride``: a fleet's worker takes every stride-th, ``fleet/shards.py``), keeps
the trace of every new failure (ddmin'd; ``failures.py``) and counts failures that a selected
``KnownFinding`` explains without stopping for them. With a ``database`` (``fleet/database.py``)
Hypothesis saves every failing case there and the first round replays what any campaign saved
before. ``device="cuda"`` runs the same machines on a GPU (``world.open_device``): each world
gets a ``PerturbedDevice`` whose seeded spins vary the timing, and each failing trace's header
records the device and the perturbation, so its replay runs the same schedule. Ctrl-C ends the
campaign between two steps: the report (``report.CampaignReport``) says what ran and that it
was interrupted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hicache_ref.campaign.budgets import check_cases_max
from hicache_ref.campaign.coverage import measure_coverage
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.rounds import CampaignSignals, RoundPlan, run_rounds
from hicache_ref.device.perturb import DEFAULT_PERTURBATION, Perturbation
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.campaigns.known_findings import KnownFinding
from hicache_ref.harness.campaigns.profiles import lockstep_enabled
from hicache_ref.harness.world.world import check_device_kind, on_device, open_device

if TYPE_CHECKING:
    from hicache_ref.fleet.database import CampaignDatabase

__all__ = ["MINIMIZE_REPLAYS_MAX", "run_campaign"]

MINIMIZE_REPLAYS_MAX = 1000
"""ddmin's replay budget per new failure (a GPU campaign passes fewer: its replays are slower)."""


def run_campaign(
    impl: str,
    *,
    seconds: float,
    profile: str,
    seed: int,
    out_dir: Path,
    examples_per_round: int | None = None,
    stop_on_failure: bool = True,
    progress: bool = True,
    minimize_failures: bool = True,
    shrink: bool = True,
    known: Sequence[KnownFinding] = (),
    device: str = "sim",
    perturbation: Perturbation | None = None,
    minimize_replays: int = MINIMIZE_REPLAYS_MAX,
    seed_stride: int = 1,
    database: CampaignDatabase | None = None,
    signals: CampaignSignals | None = None,
    on_round: Callable[[CampaignReport, float], None] | None = None,
    rounds_max: int | None = None,
    source: str = "",
    lockstep: bool | None = None,
    coverage: bool = False,
    on_case: Callable[[CampaignReport, float], None] | None = None,
    cases_max: int | None = None,
) -> CampaignReport:
    """Run rounds of the state machine until ``seconds`` pass (or a new failure, by default).

    A failure that one of ``known`` explains is counted in ``known_hits`` and the campaign goes
    on with the next round (its round ends there: Hypothesis stops a round at its first failure).
    On ``device="cuda"`` the worlds run on the GPU with ``perturbation`` (default
    ``DEFAULT_PERTURBATION``); without a GPU that is one ``HiCacheSetupError``. ``progress``
    draws a bar (a terminal) or a line now and then (a log) on stderr, unless ``on_round``
    takes each round's report instead. Ctrl-C ends it with ``interrupted`` set. ``source`` is
    the sglang tree a ``sglang``/``seed`` implementation reads (empty: its default);
    ``lockstep`` turns the pure oracle on or off (None: as the profile says,
    ``profiles.lockstep_enabled``). ``coverage`` measures the implementation's own code as it
    runs (``coverage.py``); ``on_case`` takes the report after each case (the live page,
    ``fleet/live_report.py``). ``cases_max`` (``--max-cases``) ends it after that many cases if
    the time has not ended it first: a fixed seed then runs the same cases on any host.
    """
    if not seconds > 0:
        raise HiCacheInputError(f"a campaign needs a positive time, got seconds={seconds}")
    assert seed_stride >= 1, f"seed_stride must be at least 1, got {seed_stride}"
    check_cases_max("--max-cases", cases_max)
    kind = check_device_kind(device)
    spins = (perturbation or DEFAULT_PERTURBATION) if kind != "sim" else None
    view = None
    if progress and on_round is None:
        from hicache_ref.fleet.progress import ProgressView

        view = ProgressView(seconds)
        on_round = view.on_round
    rounds = RoundPlan(
        out_dir=out_dir,
        examples_per_round=examples_per_round or (10 if profile != "campaign" else 50),
        stop_on_failure=stop_on_failure,
        minimize_replays=minimize_replays if minimize_failures else 0,
        shrink=shrink,
        known=known,
        database=database,
        signals=signals,
        on_round=on_round,
        rounds_max=rounds_max,
        lockstep=lockstep if lockstep is not None else lockstep_enabled(profile),
        cases_max=cases_max,
    )
    report = CampaignReport(impl, profile, seed, device=kind, perturbation=spins)
    report.seed_stride = seed_stride
    report.cases_max = cases_max
    report.database = database.label if database is not None else ""
    report.on_case = on_case
    try:
        with open_device(kind, spins) as build:
            implementation = on_device(get_implementation(impl, source), kind)
            report.name, report.source = implementation.name, implementation.source_tree
            report.release = _release_of(implementation.source_tree)
            with measure_coverage(implementation, coverage) as report.coverage_probe:
                run_rounds(report, implementation, seconds, rounds, build)
            if report.coverage_probe is not None:
                report.coverage, report.coverage_probe = report.coverage_probe.as_json(), None
    finally:
        report.on_case = None  # the report crosses to the fleet's process: no closures in it
        if view is not None:
            view.close()
    return report


def _release_of(source_tree: str) -> str:
    from hicache_ref.harness.adapters.sglang_tree import tree_release

    return tree_release(Path(source_tree)) if source_tree else ""
