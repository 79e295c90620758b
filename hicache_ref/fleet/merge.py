"""Merge campaign reports: a fleet's workers into one, and reports read back from JSON.

Counts add up; a configuration, an invariant id, a behaviour (``behaviours.py``) or a covered
line or branch (``merge_coverage``: the union) was first seen when its earliest worker saw it;
the campaign lasted as long as its longest worker. Failures are kept one per invariant, the
earliest found, and every later one of the same invariant (on any worker) is a repeat. The
merged report keeps its workers as ``parts`` (flattened: a merge of merges keeps the leaves),
which is what ``hicache-fuzz report`` plots one line each for.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hicache_ref.campaign.behaviours import Behaviours
from hicache_ref.campaign.report import FEATURES, CampaignReport
from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError

_SUMMED = (
    "rounds",
    "cases",
    "steps",
    "skipped_steps",
    "invariant_checks",
    "lockstep_cases",
    "lockstep_steps",
    "storage_lockstep_cases",
    "storage_lockstep_steps",
)


def get_leaves(report: CampaignReport) -> list[CampaignReport]:
    """The single-worker reports a report is made of (itself, when it is one)."""
    return (
        [leaf for part in report.parts for leaf in get_leaves(part)] if report.parts else [report]
    )


def merge_reports(reports: list[CampaignReport]) -> CampaignReport:
    """One report for all of ``reports`` (a lone single-worker report is returned as is)."""
    assert reports, "nothing to merge"
    leaves = [leaf for report in reports for leaf in get_leaves(report)]
    if len(leaves) == 1:
        return leaves[0]
    first = leaves[0]
    names = sorted({leaf.implementation for leaf in leaves})
    merged = CampaignReport(
        ", ".join(names), first.profile, min(leaf.seed for leaf in leaves), device=first.device
    )
    merged.perturbation = first.perturbation
    merged.release = first.release
    merged.worker = None
    merged.workers = len(leaves)
    merged.seed_stride = _merged_stride(leaves)
    merged.cases_max = first.cases_max  # each worker's, as --budget is
    shards = sorted({leaf.shard for leaf in leaves})
    merged.shard = shards[0] if len(shards) == 1 else f"{len(shards)} shards"
    merged.database = next((leaf.database for leaf in leaves if leaf.database), "")
    merged.seconds = max(leaf.seconds for leaf in leaves)
    merged.interrupted = any(leaf.interrupted for leaf in leaves)
    for name in _SUMMED:
        setattr(merged, name, sum(getattr(leaf, name) for leaf in leaves))
    for leaf in leaves:
        merged.rules.update(leaf.rules)
        merged.configs.update(leaf.configs)
        merged.checks_by_id.update(leaf.checks_by_id)
        merged.known_hits.update(leaf.known_hits)
        merged.repeats.update(leaf.repeats)
        merged.lockstep_off.update(leaf.lockstep_off)
        for name in FEATURES:
            merged.features[name].update(leaf.features.get(name, Counter()))
        _keep_earliest(merged.config_first_s, leaf.config_first_s)
        _keep_earliest(merged.checks_first_s, leaf.checks_first_s)
        merged.behaviours.merge(leaf.behaviours)
    merged.coverage = merge_coverage([leaf.coverage for leaf in leaves])
    _merge_failures(merged, leaves)
    merged.parts = leaves
    return merged


def merge_coverage(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the workers' coverage (``campaign/coverage.py``'s record): a line or branch
    is covered when any worker covered it, first seen when the earliest one did."""
    files: dict[str, dict[str, Any]] = {}
    for record in records:
        for name, seen in record.get("files", {}).items():
            into = files.setdefault(
                name, {"statements": seen["statements"], "branches": seen["branches"],
                       "lines": {}, "arcs": {}}
            )  # fmt: skip
            _keep_earliest(into["lines"], seen["lines"])
            _keep_earliest(into["arcs"], seen["arcs"])
    if not files:
        return {}
    core = next((record["core"] for record in records if record.get("core")), "")
    return {"core": core, "files": dict(sorted(files.items()))}


def _merged_stride(leaves: list[CampaignReport]) -> int:
    """The stride of the union of the leaves' seed lanes (``fleet/shards.py``): W workers of
    one shard of N interleave to stride N, a whole fleet to 1."""
    strides = {leaf.seed_stride for leaf in leaves}
    stride = strides.pop() if len(strides) == 1 else 1
    return stride // len(leaves) if stride % len(leaves) == 0 else 1


def _keep_earliest(into: dict[str, float], more: dict[str, float]) -> None:
    for key, at_s in more.items():
        if key not in into or at_s < into[key]:
            into[key] = at_s


def _merge_failures(merged: CampaignReport, leaves: list[CampaignReport]) -> None:
    """One failure per invariant, the earliest; later ones of it count as repeats."""
    found = [
        {**failure, "worker": failure.get("worker", leaf.worker)}
        for leaf in leaves
        for failure in leaf.failures
    ]
    found.sort(key=lambda failure: float(failure.get("found_at_s") or 0.0))
    for failure in found:
        if any(kept["invariant"] == failure["invariant"] for kept in merged.failures):
            merged.repeats[failure["invariant"]] += 1
        else:
            merged.failures.append(failure)


# -- reading reports back ----------------------------------------------------------------------
def read_reports(paths: list[Path]) -> list[CampaignReport]:
    """The campaign reports of ``hicache-fuzz run/gate --json`` files, one bad file one line."""
    reports: list[CampaignReport] = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HiCacheInputError(
                f"report {path} cannot be read ({exc}); pass the file run/gate --json wrote"
            ) from None
        reports.append(report_from_json(data, str(path)))
    return reports


def report_from_json(data: Any, where: str = "<json>") -> CampaignReport:
    """A report as ``CampaignReport.as_json`` wrote it (its parts included)."""
    if not isinstance(data, dict) or "implementation" not in data or "cases" not in data:
        raise HiCacheInputError(
            f"report {where} is not a campaign report (no implementation and cases); pass the "
            "JSON that hicache-fuzz run --json or gate --json wrote"
        )
    try:
        return _from_json(data, where)
    except (KeyError, TypeError, ValueError, ValidationError) as exc:
        raise HiCacheInputError(
            f"report {where} is malformed ({type(exc).__name__}: {exc}); pass an unedited report"
        ) from None


def _from_json(data: dict[str, Any], where: str) -> CampaignReport:
    spins = data.get("perturbation")
    report = CampaignReport(
        data["implementation"],
        data["profile"],
        int(data["seed"]),
        device=data.get("device", "sim"),
        perturbation=None if spins is None else Perturbation.model_validate(spins),
    )
    report.release = str(data.get("release", ""))
    report.seconds = float(data.get("seconds", 0.0))
    for name in _SUMMED[:5]:
        setattr(report, name, int(data.get(name, 0)))
    lockstep = data.get("lockstep", {})
    report.lockstep_cases = int(lockstep.get("cases", 0))
    report.lockstep_steps = int(lockstep.get("steps", 0))
    report.lockstep_off.update(lockstep.get("off", {}))
    report.storage_lockstep_cases = int(lockstep.get("storage_cases", 0))
    report.storage_lockstep_steps = int(lockstep.get("storage_steps", 0))
    report.seed_stride = int(data.get("seed_stride", 1))
    cases_max = data.get("cases_max")
    report.cases_max = None if cases_max is None else int(cases_max)
    report.worker = data.get("worker", 0)
    report.workers = int(data.get("workers", 1))
    report.shard = str(data.get("shard", "1/1"))
    report.database = str(data.get("database", ""))
    report.interrupted = bool(data.get("interrupted", False))
    report.rules.update(data.get("rules", {}))
    report.checks_by_id.update(data.get("checks_by_id", {}))
    report.checks_first_s.update(data.get("checks_first_s", {}))
    report.known_hits.update(data.get("known_hits", {}))
    report.repeats.update(data.get("repeats", {}))
    for name, counts in data.get("features", {}).items():
        report.features.setdefault(name, Counter()).update(counts)
    for config, seen in data.get("configs", {}).items():
        report.configs[config] = int(seen["cases"])
        if seen.get("first_s") is not None:
            report.config_first_s[config] = float(seen["first_s"])
    report.failures = list(data.get("failures", []))
    report.timeline = list(data.get("timeline", []))
    report.behaviours = Behaviours.from_json(data.get("behaviours", {}))
    report.coverage = dict(data.get("coverage", {}))
    report.parts = [_from_json(part, where) for part in data.get("parts", [])]
    return report
