"""The campaign report says which copy path ``copy_path="auto"`` takes in the cases' worlds, and
the campaign's profile decides whether the pure oracle follows its cases."""

from __future__ import annotations

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
