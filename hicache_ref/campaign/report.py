"""What a campaign exercised and found: ``CampaignReport``, the type every campaign module and
the fleet's views share.

A report counts steps, rules and rule families, the configuration features drawn, invariant
checks by id, each new failure with the one line that replays it, the known findings hit, and a
timeline (cumulative counts sampled as it ran, for ``hicache-fuzz report``). A fleet's report is
the merge of its workers' (``fleet/merge.py``), which it keeps as ``parts``. The text summary is
``summary.render_summary``; the JSON is ``CampaignReport.as_json``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hicache_ref.campaign.behaviours import Behaviours
from hicache_ref.campaign.coverage import CoverageProbe
from hicache_ref.device.perturb import Perturbation
from hicache_ref.harness.lockstep.oracle import LockstepOracle
from hicache_ref.harness.rules import RULES, rule_families
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import get_auto_copy_path

__all__ = [
    "FEATURES",
    "RULE_FAMILIES",
    "CampaignReport",
    "get_config_features",
    "get_rule_family",
]

RULE_FAMILIES: dict[str, tuple[str, ...]] = rule_families()
"""The rules of each family, from the rule records (``harness/rules/``)."""
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
    "storage sidecar",
    "storage pressure",
    "storage swa",
    "storage mode",
)


POOL_GROUP_WORLDS: dict[str, str] = {
    "none": "the pools handed to the controller themselves",
    "anchor": "a HostPoolGroup of the KV anchor alone",
    "packed": "packed MTP drafts in the anchor's host pool",
    "sidecar": "a draft sidecar riding on the KV indices",
    "swa": "an independent SWA side pool: own rows, own host slots, own transfer layers",
    "mamba": "an independent Mamba state pool: one state slot per node, own host slots",
}
"""What each ``pool_group`` world drives, as a report names it beside its share of cases."""


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
        "storage sidecar": (
            ("draft" if config.has_draft and not config.has_side_pools else "none")
            if config.uses_storage
            else "no storage"
        ),
        "storage swa": (
            (("mamba" if config.has_state_pool else "swa") if config.storage_swa_window else "none")
            if config.uses_storage
            else "no storage"
        ),
        "storage pressure": (
            ("pressure" if config.storage_host_pressure else "none")
            if config.uses_storage
            else "no storage"
        ),
        "storage mode": (
            ("buffer_only" if config.storage_buffer_only else "cache")
            if config.uses_storage
            else "no storage"
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
    lockstep_off: Counter[str] = field(default_factory=Counter)
    """Cases the pure oracle did not follow to the end, by the reason it gave (a storage step,
    a side pool, a step it cannot express): every case is in ``lockstep_cases`` or here."""
    storage_lockstep_cases: int = 0
    """Cases the storage oracle followed verb by verb (``harness/lockstep/storage.py``)."""
    storage_lockstep_steps: int = 0
    auto_copy_paths: Counter[str] = field(default_factory=Counter)
    """What ``copy_path="auto"`` would take in each case's world on this device."""
    seed_stride: int = 1
    """Round k ran seed ``seed + k * seed_stride`` (a fleet's worker takes every stride-th)."""
    cases_max: int | None = None
    """The case budget each worker ran under (``--max-cases``; None: the time budget alone)."""
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
    name: str = ""
    """The implementation's own ``name`` (what an outside ``pkg.module:factory`` calls itself)."""
    source: str = ""
    """The sglang tree the implementation read (empty for anything else)."""
    release: str = ""
    """The upstream release of the tree under test (``sglang_tree.tree_release``; empty for
    anything else): a known finding scoped to releases matches only inside its range."""
    behaviours: Behaviours = field(default_factory=Behaviours)
    """Rule/outcome pairs and checks by id, with first and last seen (``campaign/behaviours.py``)."""
    coverage: dict[str, Any] = field(default_factory=dict)
    """Coverage of the code under test (``run --coverage``; ``campaign/coverage.py``)."""
    coverage_probe: CoverageProbe | None = None
    on_case: Callable[[CampaignReport, float], None] | None = None
    """Called after each case with the seconds so far (``run_campaign(on_case=...)``)."""
    _timeline_interval_s: float = TIMELINE_INTERVAL_S

    def absorb(self, session: Session, at_s: float | None = None) -> None:
        """Count one finished case (``at_s``: seconds since the start, for first sightings)."""
        self.cases += 1
        for observer in getattr(session, "observers", ()):  # a report fed plain stats has none
            if not isinstance(observer, LockstepOracle):
                continue
            if observer.off_reason is None:
                self.lockstep_cases += 1
                self.lockstep_steps += observer.steps
            else:
                self.lockstep_off[observer.off_reason] += 1
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
        self.behaviours.absorb(getattr(session, "steps", []), getattr(session, "outcomes", []),
                               by_id, at_s)  # fmt: skip
        if at_s is not None:
            self.config_first_s.setdefault(config, round(at_s, 2))
            if self.coverage_probe is not None:
                self.coverage_probe.on_case(at_s)
            if self.on_case is not None:
                self.on_case(self, at_s)
            for inv_id in by_id:
                self.checks_first_s.setdefault(inv_id, round(at_s, 2))

    def sample(self, elapsed_s: float, *, force: bool = False) -> None:
        """Add a timeline point, at most one per interval (``force``: the final one)."""
        if self.timeline and not force:
            interval_s = min(self._timeline_interval_s, max(0.1, elapsed_s / 10))  # early: finer
            if elapsed_s - self.timeline[-1]["t"] < interval_s:
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
                **(self.coverage_probe.sample(elapsed_s) if self.coverage_probe else {}),
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

    def world_shares(self) -> dict[str, dict[str, Any]]:
        """The pool-group worlds drawn: each kind's cases, share of cases and what it drives
        (every kind listed, drawn or not, so a pass that drew none of one says so)."""
        counts = self.features.get("pool group", Counter())
        total = sum(counts.values())
        return {
            kind: {
                "cases": counts.get(kind, 0),
                "share": round(counts.get(kind, 0) / total, 4) if total else 0.0,
                "drives": drives,
            }
            for kind, drives in POOL_GROUP_WORLDS.items()
        }

    def _storage_world_share(self, feature: str, drawn: str, drives: str) -> dict[str, Any]:
        """Storage worlds whose ``feature`` was ``drawn`` (the others count ``none``, or another
        value): their cases and their share of the storage worlds (0 cases when none was
        drawn)."""
        counts = self.features.get(feature, Counter())
        storage = sum(c for value, c in counts.items() if value != "no storage")
        return {
            "cases": counts.get(drawn, 0),
            "share_of_storage": round(counts.get(drawn, 0) / storage, 4) if storage else 0.0,
            "drives": drives,
        }

    def sidecar_shares(self) -> dict[str, Any]:
        """Storage worlds that carried a draft sidecar into L3 (``batch_*_v2``)."""
        return self._storage_world_share(
            "storage sidecar",
            "draft",
            "a draft pool's pages stored, queried and read beside the KV's",
        )

    def pressure_shares(self) -> dict[str, Any]:
        """Storage worlds under host pressure (a prefetch or a hit cut to the free host pages)."""
        return self._storage_world_share(
            "storage pressure",
            "pressure",
            "a prefetch or a hit cut to the free host pages (the radix caches' "
            "fallback, allocate_storage_hit(allow_partial=True))",
        )

    def swa_shares(self) -> dict[str, Any]:
        """Storage worlds that carried an independent SWA side pool's window into L3 (its
        trailing pages: ``TRAILING_PAGES``, ``_sync_trailing_keys``, ``_page_transfer_sidecar``)."""
        return self._storage_world_share(
            "storage swa",
            "swa",
            "an SWA side pool's trailing window stored, found and read after the KV's",
        )

    def mamba_shares(self) -> dict[str, Any]:
        """Storage worlds that carried a Mamba state pool's page into L3 (one state per node,
        the served hit's last page: ``TRAILING_PAGES`` with a window of one)."""
        return self._storage_world_share(
            "storage swa",
            "mamba",
            "a Mamba state pool's one page per node stored, found and read after the KV's",
        )

    def buffer_shares(self) -> dict[str, Any]:
        """Storage worlds in ``buffer_only`` host memory (host pages as staging, the tree's
        storage existence beliefs: ``harness/driver/storage_buffer.py``)."""
        return self._storage_world_share(
            "storage mode",
            "buffer_only",
            "host memory as a write staging buffer freed at the storage ack, and the tree's "
            "storage existence beliefs taught, healed and checked (INV-41)",
        )

    def family_shares(self) -> dict[str, float]:
        applied = sum(self.rules.values())
        return {f: (c / applied if applied else 0.0) for f, c in self.families.items()}

    def as_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "implementation_name": self.name,
            "source": self.source,
            "release": self.release,
            "profile": self.profile,
            "seed": self.seed,
            "seed_stride": self.seed_stride,
            "cases_max": self.cases_max,
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
            "worlds": {
                "pool group": self.world_shares(),
                "storage sidecar": self.sidecar_shares(),
                "storage pressure": self.pressure_shares(),
                "storage swa": self.swa_shares(),
                "storage mamba": self.mamba_shares(),
                "storage buffer": self.buffer_shares(),
            },
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
                "off": dict(sorted(self.lockstep_off.items())),
                "storage_cases": self.storage_lockstep_cases,
                "storage_steps": self.storage_lockstep_steps,
            },
            "auto_copy_paths": dict(sorted(self.auto_copy_paths.items())),
            "timeline": self.timeline,
            "behaviours": self.behaviours.as_json(),
            "coverage": self.coverage_probe.as_json() if self.coverage_probe else self.coverage,
            "parts": [part.as_json() for part in self.parts],
        }
