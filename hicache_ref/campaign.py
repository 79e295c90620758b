"""Fuzz campaigns: rounds of the state machine against one implementation, and their report.

``run_campaign`` runs seeded rounds (``campaign_rounds.py``) until the time is up (round k
uses ``seed + k * seed_stride``: a fleet's worker takes every stride-th, ``fleet/shards.py``),
keeps the trace of every new failure (ddmin'd; ``campaign_failures.py``) and counts failures
that a selected ``KnownFinding`` explains without stopping for them. With a ``database``
(``fleet/database.py``) Hypothesis saves every failing case there and the first round replays
what any campaign saved before. ``device="cuda"`` runs the same machines on a GPU
(``world.open_device``): each world gets a ``PerturbedDevice`` whose seeded spins vary the
timing, and each failing trace's header records the device and the perturbation, so its replay
runs the same schedule. Ctrl-C ends the campaign between two steps: the report says what ran
and that it was interrupted.

``CampaignReport`` says what the campaign exercised: steps, rules and rule families, the
configuration features drawn, invariant checks by id, each failure with the one line that
replays it, and a timeline (cumulative counts sampled as it ran, for ``hicache-fuzz report``).
A fleet's report is the merge of its workers' (``fleet/merge.py``), which it keeps as ``parts``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_ref.campaign_failures import (
    RecordedFailure,
    get_campaign_failure,
    get_failure_invariant,
    get_root_failure,
    stamp_device,
)
from hicache_ref.campaign_rounds import CampaignSignals, RoundPlan, run_rounds
from hicache_ref.campaign_summary import render_summary
from hicache_ref.device.perturb import DEFAULT_PERTURBATION, Perturbation
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.campaigns.known_findings import KnownFinding
from hicache_ref.harness.lockstep.oracle import LockstepOracle
from hicache_ref.harness.steps.rules import RULES, rule_families
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import (
    check_device_kind,
    get_auto_copy_path,
    on_device,
    open_device,
)

if TYPE_CHECKING:
    from hicache_ref.fleet.database import CampaignDatabase

__all__ = [
    "FEATURES",
    "MINIMIZE_REPLAYS_MAX",
    "RULE_FAMILIES",
    "CampaignReport",
    "CampaignSignals",
    "RecordedFailure",
    "get_campaign_failure",
    "get_config_features",
    "get_failure_invariant",
    "get_root_failure",
    "get_rule_family",
    "run_campaign",
    "stamp_device",
]

MINIMIZE_REPLAYS_MAX = 1000
"""ddmin's replay budget per new failure (a GPU campaign passes fewer: its replays are slower)."""

RULE_FAMILIES: dict[str, tuple[str, ...]] = rule_families()
"""The rules of each family, from the rule records (``harness/steps/rules.py``)."""
FEATURES = (
    "pool",
    "layout/io",
    "cp",
    "draft",
    "page",
    "copy",
    "hybrid",
    "forward",
    "pool group",
    "storage",
)


def get_rule_family(rule: str) -> str:
    """The family a machine rule belongs to (``probe_*`` rules are misuse, unknown ones other)."""
    record = RULES.get(rule)
    if record is not None:
        return record.family
    return "misuse" if rule.startswith("probe_") else "other"


def get_config_features(config: HarnessConfig) -> dict[str, str]:
    """The features of one drawn configuration that a campaign report counts."""
    if not config.has_draft:
        draft = "none"
    elif config.draft_layer_num > config.layer_num:
        draft = "deeper"
    elif config.draft_layer_num < config.layer_num:
        draft = "shallower"
    else:
        draft = "same"
    return {
        "pool": config.pool_kind,
        "layout/io": f"{config.layout}/{config.io_backend}",
        "cp": str(config.cp_size),
        "draft": draft,
        "page": str(config.page_size),
        "copy": config.copy_path,
        "hybrid": "yes" if config.hybrid else "no",
        "forward": "own-stream" if config.forward_stream else "default",
        "pool group": config.pool_group,
        "storage": (
            f"{config.storage_ranks}r/{config.storage_backend}"
            + ("+faults" if config.storage_faults else "")
            if config.uses_storage
            else "none"
        ),
    }


TIMELINE_POINTS_MAX = 400
"""A timeline longer than this keeps every other point and samples half as often."""
TIMELINE_INTERVAL_S = 1.0


@dataclass
class CampaignReport:
    implementation: str
    profile: str
    seed: int
    device: str = "sim"
    perturbation: Perturbation | None = None
    seconds: float = 0.0
    rounds: int = 0
    cases: int = 0
    steps: int = 0
    skipped_steps: int = 0
    invariant_checks: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    features: dict[str, Counter[str]] = field(
        default_factory=lambda: {name: Counter() for name in FEATURES}
    )
    checks_by_id: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    """New failures: one record per distinct invariant, with its minimized trace."""
    repeats: Counter[str] = field(default_factory=Counter)
    """Further new failures of an invariant already in ``failures`` (not minimized again)."""
    known_hits: Counter[str] = field(default_factory=Counter)
    """Failures explained by a selected known finding, by finding id."""
    lockstep_cases: int = 0
    """Cases the pure oracle followed step by step (``harness/lockstep/oracle.py``)."""
    lockstep_steps: int = 0
    storage_lockstep_cases: int = 0
    """Cases the storage oracle followed verb by verb (``harness/lockstep/storage.py``)."""
    storage_lockstep_steps: int = 0
    auto_copy_paths: Counter[str] = field(default_factory=Counter)
    """What ``copy_path="auto"`` would take in each case's world on this device."""
    seed_stride: int = 1
    """Round k ran seed ``seed + k * seed_stride`` (a fleet's worker takes every stride-th)."""
    worker: int | None = 0
    """This worker's index in its fleet (None: a merge of several workers)."""
    workers: int = 1
    shard: str = "1/1"
    database: str = ""
    """The failure database it read and wrote (``--database``), passwords left out."""
    interrupted: bool = False
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Cumulative counts sampled as the campaign ran (``t`` in seconds since it started)."""
    config_first_s: dict[str, float] = field(default_factory=dict)
    checks_first_s: dict[str, float] = field(default_factory=dict)
    parts: list[CampaignReport] = field(default_factory=list)
    """A merged report's workers, each its own report."""
    release: str = ""
    """The upstream release of the tree under test (``sglang_tree.tree_release``; empty for
    anything else): a known finding scoped to releases matches only inside its range."""
    _timeline_interval_s: float = TIMELINE_INTERVAL_S

    def absorb(self, session: Session, at_s: float | None = None) -> None:
        """Count one finished case (``at_s``: seconds since the start, for first sightings)."""
        self.cases += 1
        for observer in getattr(session, "observers", ()):  # a report fed plain stats has none
            if isinstance(observer, LockstepOracle) and observer.off_reason is None:
                self.lockstep_cases += 1
                self.lockstep_steps += observer.steps
        storage_steps = getattr(session.stats, "lockstep", {}).get("storage_steps_in_lockstep", 0)
        if storage_steps:
            self.storage_lockstep_cases += 1
            self.storage_lockstep_steps += storage_steps
        self.steps += session.stats.steps
        self.skipped_steps += session.stats.skipped
        self.invariant_checks += session.stats.invariant_checks
        self.rules.update(session.stats.rules)
        by_id = getattr(session.stats, "checks_by_id", None) or {}
        self.checks_by_id.update(by_id)
        config = session.config.describe().split(" alloc=")[0]
        self.configs[config] += 1
        for name, value in get_config_features(session.config).items():
            self.features[name][value] += 1
        world = getattr(session, "world", None)  # a report fed plain stats has none
        if world is not None:
            self.auto_copy_paths[get_auto_copy_path(world)] += 1
        if at_s is not None:
            self.config_first_s.setdefault(config, round(at_s, 2))
            for inv_id in by_id:
                self.checks_first_s.setdefault(inv_id, round(at_s, 2))

    def sample(self, elapsed_s: float, *, force: bool = False) -> None:
        """Add a timeline point, at most one per interval (``force``: the final one)."""
        if self.timeline and not force:
            if elapsed_s - self.timeline[-1]["t"] < self._timeline_interval_s:
                return
        self.timeline.append(
            {
                "t": round(elapsed_s, 2),
                "cases": self.cases,
                "steps": self.steps,
                "failures": len(self.failures) + sum(self.repeats.values()),
                "known": sum(self.known_hits.values()),
                "configs": len(self.configs),
                "families": dict(self.families),
            }
        )
        if len(self.timeline) > TIMELINE_POINTS_MAX:
            self.timeline = [*self.timeline[:-1:2], self.timeline[-1]]
            self._timeline_interval_s *= 2

    @property
    def device_label(self) -> str:
        if self.device == "sim":
            return "SimDevice"
        spins = f", {self.perturbation.describe()}" if self.perturbation is not None else ""
        return f"{self.device} (perturbed{spins})"

    @property
    def families(self) -> Counter[str]:
        counts: Counter[str] = Counter({family: 0 for family in RULE_FAMILIES})
        for rule, count in self.rules.items():
            counts[get_rule_family(rule)] += count
        return counts

    def family_shares(self) -> dict[str, float]:
        applied = sum(self.rules.values())
        return {f: (c / applied if applied else 0.0) for f, c in self.families.items()}

    def as_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "release": self.release,
            "profile": self.profile,
            "seed": self.seed,
            "seed_stride": self.seed_stride,
            "worker": self.worker,
            "workers": self.workers,
            "shard": self.shard,
            "database": self.database,
            "device": self.device,
            "perturbation": None if self.perturbation is None else self.perturbation.model_dump(),
            "interrupted": self.interrupted,
            "seconds": round(self.seconds, 2),
            "rounds": self.rounds,
            "cases": self.cases,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "invariant_checks": self.invariant_checks,
            "checks_by_id": dict(sorted(self.checks_by_id.items())),
            "checks_first_s": dict(sorted(self.checks_first_s.items())),
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "rules": dict(sorted(self.rules.items())),
            "rule_families": {
                family: {"steps": self.families[family], "share": round(share, 4)}
                for family, share in self.family_shares().items()
            },
            "features": {name: dict(sorted(c.items())) for name, c in self.features.items()},
            "distinct_configs": len(self.configs),
            "configs": {
                config: {"cases": count, "first_s": self.config_first_s.get(config)}
                for config, count in sorted(self.configs.items())
            },
            "failures": self.failures,
            "repeats": dict(sorted(self.repeats.items())),
            "known_hits": dict(sorted(self.known_hits.items())),
            "lockstep": {
                "cases": self.lockstep_cases,
                "steps": self.lockstep_steps,
                "storage_cases": self.storage_lockstep_cases,
                "storage_steps": self.storage_lockstep_steps,
            },
            "auto_copy_paths": dict(sorted(self.auto_copy_paths.items())),
            "timeline": self.timeline,
            "parts": [part.as_json() for part in self.parts],
        }

    def render(self, *, replay_lines: bool = True) -> str:
        """The summary; ``replay_lines=False`` leaves the replay lines to the caller (the gate)."""
        return render_summary(self, replay_lines=replay_lines)


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
) -> CampaignReport:
    """Run rounds of the state machine until ``seconds`` pass (or a new failure, by default).

    A failure that one of ``known`` explains is counted in ``known_hits`` and the campaign goes
    on with the next round (its round ends there: Hypothesis stops a round at its first failure).
    On ``device="cuda"`` the worlds run on the GPU with ``perturbation`` (default
    ``DEFAULT_PERTURBATION``); without a GPU that is one ``HiCacheSetupError``. ``progress``
    draws a bar (a terminal) or a line now and then (a log) on stderr, unless ``on_round``
    takes each round's report instead. Ctrl-C ends it with ``interrupted`` set.
    """
    if not seconds > 0:
        raise HiCacheInputError(f"a campaign needs a positive time, got seconds={seconds}")
    assert seed_stride >= 1, f"seed_stride must be at least 1, got {seed_stride}"
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
    )
    report = CampaignReport(impl, profile, seed, device=kind, perturbation=spins)
    report.seed_stride = seed_stride
    report.database = database.label if database is not None else ""
    try:
        with open_device(kind, spins) as build:
            implementation = on_device(get_implementation(impl), kind)
            report.release = _release_of(implementation.source_tree)
            run_rounds(report, implementation, seconds, rounds, build)
    finally:
        if view is not None:
            view.close()
    return report


def _release_of(source_tree: str) -> str:
    from hicache_ref.harness.adapters.sglang_tree import tree_release

    return tree_release(Path(source_tree)) if source_tree else ""
