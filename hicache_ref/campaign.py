"""Fuzz campaigns: rounds of the state machine against one implementation, and their report.

``run_campaign`` runs seeded rounds until the time is up, keeps the trace of every new failure
(minimized with ddmin) and counts failures that a selected ``KnownFinding`` explains without
stopping for them. ``device="cuda"`` runs the same machines on a GPU (``world.use_device``):
each world gets a ``PerturbedDevice`` whose seeded spins vary the timing, and each failing
trace's header records the device and the perturbation, so its replay runs the same schedule. ``CampaignReport`` says what the campaign exercised: steps, rules and rule
families, the configuration features drawn, invariant checks (by id when the session counts
them), and each failure with the one line that replays it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.stateful import run_state_machine_as_test

from hicache_ref.device.perturb import DEFAULT_PERTURBATION, Perturbation
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.harness import machine as machine_module
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.config import HarnessConfig
from hicache_ref.harness.known_findings import KnownFinding, match_known_finding
from hicache_ref.harness.lockstep import LockstepOracle
from hicache_ref.harness.machine import machine_for
from hicache_ref.harness.profiles import make_settings
from hicache_ref.harness.replay import minimize
from hicache_ref.harness.rules import RULES, rule_families
from hicache_ref.harness.session import Session
from hicache_ref.harness.trace import Trace
from hicache_ref.harness.world import (
    check_device_kind,
    get_auto_copy_path,
    on_device,
    use_device,
)
from hicache_ref.invariants.checks_storage import STORAGE_IDS

MINIMIZE_REPLAYS_MAX = 1000
"""ddmin's replay budget per new failure (a GPU campaign passes fewer: its replays are slower)."""

RULE_FAMILIES: dict[str, tuple[str, ...]] = rule_families()
"""The rules of each family, from the rule records (``harness/rules.py``)."""
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


def get_failure_invariant(exc: BaseException) -> str:
    """The invariant a failure broke (``INV-xx``), or its exception type when it is no violation."""
    inv = getattr(exc, "inv_id", None)
    return inv if isinstance(inv, str) else type(exc).__name__


def get_root_failure(exc: BaseException) -> BaseException:
    """The failure inside an exception group (Hypothesis' ``FlakyFailure`` wraps the first run's
    error when a re-run passed, which a GPU's timing can make happen), else ``exc`` itself."""
    inner = getattr(exc, "exceptions", None)
    if not inner:
        return exc
    leaves = [get_root_failure(e) for e in inner if isinstance(e, BaseException)]
    violations = [e for e in leaves if isinstance(getattr(e, "inv_id", None), str)]
    return (violations or leaves or [exc])[0]


class RecordedFailure(Exception):
    """A failure known from its trace's note only: Hypothesis saw it, then its re-run drew a
    different program (a real device's timing changes which rules are enabled) and it raised a
    ``Flaky`` error of its own. ``inv_id`` is the recorded failure's invariant or type."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        kind, _, rest = note.partition(": ")
        found = re.match(r"(INV-\d\d)\b", rest)
        self.inv_id = found.group(1) if found else kind


def get_campaign_failure(exc: BaseException) -> BaseException:
    """What a round's exception says was found: the root failure, or for a Hypothesis ``Flaky``
    error with nothing inside, the failure its last trace recorded (``RecordedFailure``)."""
    failure = get_root_failure(exc)
    last = machine_module.LAST_FAILURE.get("path")
    if isinstance(failure, Flaky) and last is not None:
        note = Trace.read(Path(last)).header.note
        if note:
            return RecordedFailure(note)
    return failure


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
    failures: list[dict[str, str]] = field(default_factory=list)
    """New failures: one record per distinct invariant, with its minimized trace."""
    repeats: Counter[str] = field(default_factory=Counter)
    """Further new failures of an invariant already in ``failures`` (not minimized again)."""
    known_hits: Counter[str] = field(default_factory=Counter)
    """Failures explained by a selected known finding, by finding id."""
    lockstep_cases: int = 0
    """Cases the pure oracle followed step by step (``harness/lockstep.py``)."""
    lockstep_steps: int = 0
    auto_copy_paths: Counter[str] = field(default_factory=Counter)
    """What ``copy_path="auto"`` would take in each case's world on this device."""

    def absorb(self, session: Session) -> None:
        self.cases += 1
        for observer in getattr(session, "observers", ()):  # a report fed plain stats has none
            if isinstance(observer, LockstepOracle) and observer.off_reason is None:
                self.lockstep_cases += 1
                self.lockstep_steps += observer.steps
        self.steps += session.stats.steps
        self.skipped_steps += session.stats.skipped
        self.invariant_checks += session.stats.invariant_checks
        self.rules.update(session.stats.rules)
        self.checks_by_id.update(getattr(session.stats, "checks_by_id", None) or {})
        self.configs[session.config.describe().split(" alloc=")[0]] += 1
        for name, value in get_config_features(session.config).items():
            self.features[name][value] += 1
        world = getattr(session, "world", None)  # a report fed plain stats has none
        if world is not None:
            self.auto_copy_paths[get_auto_copy_path(world)] += 1

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
            "profile": self.profile,
            "seed": self.seed,
            "device": self.device,
            "perturbation": None if self.perturbation is None else self.perturbation.model_dump(),
            "seconds": round(self.seconds, 2),
            "rounds": self.rounds,
            "cases": self.cases,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "invariant_checks": self.invariant_checks,
            "checks_by_id": dict(sorted(self.checks_by_id.items())),
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "rules": dict(sorted(self.rules.items())),
            "rule_families": {
                family: {"steps": self.families[family], "share": round(share, 4)}
                for family, share in self.family_shares().items()
            },
            "features": {name: dict(sorted(c.items())) for name, c in self.features.items()},
            "distinct_configs": len(self.configs),
            "failures": self.failures,
            "repeats": dict(sorted(self.repeats.items())),
            "known_hits": dict(sorted(self.known_hits.items())),
            "lockstep": {"cases": self.lockstep_cases, "steps": self.lockstep_steps},
            "auto_copy_paths": dict(sorted(self.auto_copy_paths.items())),
        }

    def render(self, *, replay_lines: bool = True) -> str:
        """The summary; ``replay_lines=False`` leaves the replay lines to the caller (the gate)."""
        lines = [
            f"hicache-fuzz: {self.implementation} on {self.device_label}, profile {self.profile}, "
            f"seed {self.seed}",
            f"  {self.cases} cases, {self.steps} steps ({self.skipped_steps} skipped) in "
            f"{self.seconds:.1f}s = {self.steps / max(self.seconds, 1e-9):.0f} steps/s; "
            f"{self.invariant_checks} invariant checks; {len(self.configs)} distinct configs",
            "  rules hit: " + ", ".join(f"{k}={v}" for k, v in sorted(self.rules.items())),
            "  rule families (share of applied steps): "
            + ", ".join(f"{f} {s:.0%}" for f, s in self.family_shares().items()),
            "  configs: " + "; ".join(_render_feature(n, c) for n, c in self.features.items()),
            "  copy_path auto takes here (cases): "
            + (" ".join(f"{k}={v}" for k, v in sorted(self.auto_copy_paths.items())) or "-"),
        ]
        lines.append(
            f"  lockstep oracle: {self.lockstep_cases} of {self.cases} cases, "
            f"{self.lockstep_steps} steps compared"
            + ("" if self.lockstep_cases else " (off: profile, HICACHE_LOCKSTEP or device)")
        )
        storage = {r: n for r, n in sorted(self.rules.items()) if get_rule_family(r) == "storage"}
        if storage:
            ids = {i: n for i, n in sorted(self.checks_by_id.items()) if i in STORAGE_IDS}
            lines.append(
                f"  storage: {self.family_shares().get('storage', 0.0):.0%} of applied steps ("
                + ", ".join(f"{k}={v}" for k, v in storage.items())
                + "); checks "
                + ", ".join(f"{k}={v}" for k, v in ids.items())
            )
        if self.checks_by_id:
            lines.append(
                "  checks by invariant: "
                + ", ".join(f"{k}={v}" for k, v in sorted(self.checks_by_id.items()))
            )
        if self.known_hits:
            lines.append(
                "  known findings hit: "
                + ", ".join(f"{k} x{v}" for k, v in sorted(self.known_hits.items()))
            )
        if self.failures:
            lines.append(f"  FAILURES: {len(self.failures)}")
            for failure in self.failures:
                repeats = self.repeats[failure["invariant"]]
                again = f" (and {repeats} more like it)" if repeats else ""
                lines.append(f"    {failure['error']}{again}")
                if replay_lines:
                    lines.append(f"    replay: hicache-fuzz replay {failure['trace']}")
        else:
            lines.append("  failures: none" + (" new" if self.known_hits else ""))
        return "\n".join(lines)


def _render_feature(name: str, counts: Counter[str]) -> str:
    ordered = sorted(counts.items(), key=lambda item: _natural_key(item[0]))
    inner = " ".join(f"{value}={count}" for value, count in ordered)
    return f"{name} {inner or '-'}"


def _natural_key(value: str) -> tuple[int, int, str]:
    """Numbers in numeric order (page 1 2 4 16), then names in alphabetical order."""
    return (0, int(value), "") if value.isdigit() else (1, 0, value)


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
) -> CampaignReport:
    """Run rounds of the state machine until ``seconds`` pass (or a new failure, by default).

    A failure that one of ``known`` explains is counted in ``known_hits`` and the campaign goes
    on with the next round (its round ends there: Hypothesis stops a round at its first failure).
    On ``device="cuda"`` the worlds run on the GPU with ``perturbation`` (default
    ``DEFAULT_PERTURBATION``); without a GPU that is one ``HiCacheSetupError``.
    """
    if not seconds > 0:
        raise HiCacheInputError(f"a campaign needs a positive time, got seconds={seconds}")
    kind = check_device_kind(device)
    spins = (perturbation or DEFAULT_PERTURBATION) if kind != "sim" else None
    with use_device(kind, spins):
        implementation = on_device(get_implementation(impl), kind)
        report = CampaignReport(impl, profile, seed, device=kind, perturbation=spins)
        _run_rounds(
            report,
            implementation,
            seconds=seconds,
            out_dir=out_dir,
            examples_per_round=examples_per_round,
            stop_on_failure=stop_on_failure,
            progress=progress,
            minimize_replays=minimize_replays if minimize_failures else 0,
            shrink=shrink,
            known=known,
        )
    return report


def _run_rounds(
    report: CampaignReport,
    implementation: Implementation,
    *,
    seconds: float,
    out_dir: Path,
    examples_per_round: int | None,
    stop_on_failure: bool,
    progress: bool,
    minimize_replays: int,
    shrink: bool,
    known: Sequence[KnownFinding],
) -> None:
    """The campaign's rounds, under the device binding ``run_campaign`` set up."""
    impl, profile, seed = report.implementation, report.profile, report.seed
    machine_class = machine_for(implementation, impl)
    machine_module.STATS_SINKS.append(report.absorb)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    bar = _progress_bar(seconds, progress)
    os.environ[machine_module.FAILURE_DIR_ENV] = str(out_dir)
    per_round = examples_per_round or (10 if profile != "campaign" else 50)
    try:
        while time.monotonic() - start < seconds:
            round_seed = seed + report.rounds
            seeded = hypothesis_seed(round_seed)(machine_class)
            machine_module.LAST_FAILURE.clear()
            try:
                run_state_machine_as_test(
                    seeded,
                    settings=make_settings(
                        profile, shrink=shrink, max_examples=per_round, derandomize=False
                    ),
                )
            except HiCacheSetupError:
                raise  # the implementation cannot be built: no finding, a setup problem
            except Unsatisfiable as exc:
                raise HiCacheSetupError(
                    f"implementation {impl!r} supports no configuration the harness draws "
                    f"(capabilities: {sorted(implementation.capabilities)}); fix its capabilities"
                ) from exc
            except Exception as exc:  # a found bug: record it, keep its trace
                failure = get_campaign_failure(exc)
                is_new = _absorb_failure(
                    report, failure, out_dir, round_seed, minimize_replays, known
                )
                if is_new and stop_on_failure:
                    break
            finally:
                report.rounds += 1
                _update_bar(bar, report, seconds, time.monotonic() - start)
    finally:
        machine_module.STATS_SINKS.remove(report.absorb)
        if bar is not None:
            bar.close()
    report.seconds = time.monotonic() - start


def _absorb_failure(
    report: CampaignReport,
    exc: BaseException,
    out_dir: Path,
    round_seed: int,
    minimize_replays: int,
    known: Sequence[KnownFinding],
) -> bool:
    """Count a known failure or record a new one; True when it is new."""
    invariant = get_failure_invariant(exc)
    finding = match_known_finding(known, report.implementation, invariant, str(exc))
    if finding is not None:
        report.known_hits[finding.id] += 1
        return False
    if any(f["invariant"] == invariant for f in report.failures):
        report.repeats[invariant] += 1
        return True
    record = _record_failure(exc, out_dir, report, round_seed, minimize_replays)
    report.failures.append({**record, "invariant": invariant})
    return True


def _record_failure(
    exc: BaseException,
    out_dir: Path,
    report: CampaignReport,
    round_seed: int,
    minimize_replays: int,
) -> dict[str, str]:
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    last = machine_module.LAST_FAILURE.get("path")
    record = {"error": error, "seed": str(round_seed), "trace": ""}
    if last is None:
        return record
    stamp = f"{report.implementation.replace(':', '-')}-seed{round_seed}"
    kept = out_dir / f"failure-{stamp}.jsonl"
    # the header says where the case ran (the machine's printed line names this file too)
    trace = stamp_device(Trace.read(Path(last)), report.device, report.perturbation)
    trace.write(Path(last))
    shutil.copyfile(last, kept)
    record["trace"] = str(kept)
    if minimize_replays > 0:
        small = minimize(trace, max_replays=minimize_replays)
        small_path = small.write(out_dir / f"failure-{stamp}-min.jsonl")
        record["trace"] = str(small_path)
        record["steps"] = str(len(small.steps))
    return record


def stamp_device(trace: Trace, device: str, perturbation: Perturbation | None) -> Trace:
    """``trace`` with its header naming ``device`` and the perturbation it ran under."""
    if device == "sim" and perturbation is None:
        return trace
    header = trace.header.model_copy(update={"device": device, "perturbation": perturbation})
    return Trace(header=header, steps=trace.steps)


def _progress_bar(total: float, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; without it the campaign still runs
        return None
    return tqdm(
        total=total,
        unit="s",
        desc="fuzzing",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}",
    )


def _update_bar(bar: Any, report: CampaignReport, total: float, elapsed: float) -> None:
    if bar is None:
        return
    bar.n = min(total, round(elapsed, 1))
    postfix: dict[str, int] = {"cases": report.cases, "steps": report.steps}
    postfix["failures"] = len(report.failures)
    if report.known_hits:
        postfix["known"] = sum(report.known_hits.values())
    bar.set_postfix(**postfix)
    bar.refresh()
