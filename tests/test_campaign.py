"""The campaign report says which copy path ``copy_path="auto"`` takes in the cases' worlds, and
the campaign's profile decides whether the pure oracle follows its cases."""

from __future__ import annotations

import ast
import gc
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from hicache_ref import cli
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.run import run_campaign
from hicache_ref.campaign.summary import render_summary
from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.campaigns.profiles import PROFILE_HELP, PROFILES
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig


def test_the_report_counts_what_auto_takes_in_each_world() -> None:
    report = CampaignReport("reference", "ci", 0)
    # two real simulated worlds (a CP one and a plain one): on the CPU auto is gather
    for config in (HarnessConfig(), HarnessConfig(pool_kind="nsa", cp_size=2, copy_path="runs")):
        report.absorb(Session(config, ReferenceImplementation(), "reference"))
    # a report fed plain stats (no world) counts nothing there
    stats = SimpleNamespace(steps=0, skipped=0, rules=Counter(), invariant_checks=0)
    report.absorb(cast(Session, SimpleNamespace(stats=stats, config=HarnessConfig())))
    assert report.as_json()["auto_copy_paths"] == {"gather": 2}
    assert "copy_path auto takes here (cases): gather=2" in render_summary(report)


def test_the_campaign_profile_runs_no_lockstep_oracle(tmp_path: Path) -> None:
    # --profile campaign -> no case followed by the pure oracle; ci -> cases followed
    campaign = _short_run(tmp_path / "campaign", "campaign")
    ci = _short_run(tmp_path / "ci", "ci")
    assert campaign.cases > 0 and campaign.lockstep_cases == 0
    assert ci.lockstep_cases > 0


def test_the_profile_decides_even_when_the_environment_names_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # HICACHE_PROFILE is how a pytest run picks a profile; a campaign's own profile wins
    monkeypatch.setenv("HICACHE_PROFILE", "ci")
    monkeypatch.delenv("HICACHE_LOCKSTEP", raising=False)
    assert _short_run(tmp_path, "campaign").lockstep_cases == 0


def test_every_profile_says_what_it_does_in_help() -> None:
    commands = cli._subparsers(cli.build_parser())
    for command in ("run", "gate", "mutants"):
        text = " ".join(commands[command].format_help().split())
        for name in PROFILES:
            assert f"{name}: {PROFILE_HELP[name]}" in text, (command, name)
    assert "no lockstep oracle" in PROFILE_HELP["campaign"]


def _short_run(out: Path, profile: str) -> CampaignReport:
    return run_campaign(
        "reference", seconds=30.0, profile=profile, seed=0, out_dir=out, progress=False,
        rounds_max=1, examples_per_round=3,
    )  # fmt: skip


PACKAGE = Path(__file__).resolve().parents[1] / "hicache_ref"


def _imports(path: Path) -> set[str]:
    """Every ``hicache_ref`` module ``path`` imports, type-only and function-level ones too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("hicache_ref.")}


def test_the_campaign_and_the_fleet_import_one_way_round() -> None:
    # fleet/progress reads CampaignReport (campaign/report.py) without importing the campaign,
    # and no campaign module reaches back into a module that imports it
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        ): path
        for folder in ("campaign", "fleet")
        for path in (PACKAGE / folder).rglob("*.py")
    }
    edges = {name: _imports(path) & set(modules) for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges[start] - seen:
            if nxt == goal or reaches(nxt, goal, seen | {nxt}):
                return True
        return False

    circles = sorted(name for name in modules if reaches(name, name, set()))
    assert not circles, circles
    assert _imports(modules["hicache_ref.fleet.progress"]) == {
        "hicache_ref.campaign.report",
        "hicache_ref.campaign.report.CampaignReport",
    }
    harness_campaigns = (PACKAGE / "harness" / "campaigns").rglob("*.py")
    upward = [p.name for p in harness_campaigns if any(
        m.startswith("hicache_ref.campaign.") for m in _imports(p)
    )]  # fmt: skip
    assert not upward, upward


ENVIRONMENT_WRITES = re.compile(
    r"os\.environ\[[^\]]+\]\s*=|os\.environ\.(update|setdefault|pop)\(|os\.putenv\(|"
    r"os\.unsetenv\("
)
NEEDS_THE_ENVIRONMENT = {
    "distributed/group.py": "NCCL reads its settings (NVLink multicast off) from the environment"
}


def test_no_module_passes_a_value_through_the_environment() -> None:
    # the sglang tree, the profile and the lockstep choice are arguments; only settings a C
    # library reads from the process environment are written there
    writers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if ENVIRONMENT_WRITES.search(path.read_text())
    }
    assert writers <= set(NEEDS_THE_ENVIRONMENT), writers - set(NEEDS_THE_ENVIRONMENT)


def test_a_campaign_ends_at_its_budget_between_two_cases(tmp_path: Path) -> None:
    # a campaign-profile round (50 cases of 120 steps) lasts seconds; the budget cuts the round
    # short between two cases, so a fleet's workers end together instead of a round apart
    report = run_campaign(
        "reference", seconds=1.0, profile="campaign", seed=0, out_dir=tmp_path, progress=False
    )
    assert report.rounds == 1 and 1 <= report.cases < 50
    assert report.seconds < 1.0 + 2.0  # one case past the budget at most, on a loaded machine
    assert not report.interrupted and not report.failures


def test_a_process_freezes_its_long_lived_objects_once(tmp_path: Path) -> None:
    # a campaign freezes what is alive at its start (the collector then skips the imports); a
    # frozen object is never collected, so a second freeze at the next campaign's start kept
    # the first one's leftovers for good (pytest, the catalogue: one campaign after another)
    _short_run(tmp_path / "first", "ci")
    frozen = gc.get_freeze_count()
    assert frozen > 0
    report = _short_run(tmp_path / "second", "ci")
    assert report.cases > 0 and not report.failures
    # nothing frozen since (a frozen object that dies by its reference count still leaves)
    assert gc.get_freeze_count() <= frozen
