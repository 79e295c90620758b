"""The campaign report says which copy path ``copy_path="auto"`` takes in the cases' worlds."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import cast

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.summary import render_summary
from hicache_ref.harness.adapters import ReferenceImplementation
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
