"""The campaign profile's PCT-style bias: the highest-priority thread runs until a change point.

A case's priorities and change points come from its seed alone, so the same case picks the same
threads again; the default profiles keep the uniform draw. A failure found under the bias names
the depth and the priority changes its case passed, in the report and in ``--json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.campaign.run import run_campaign
from hicache_ref.campaign.summary import render_pct, render_summary
from hicache_ref.harness.schedule.pct import PCT_DEPTH, PctBias, campaign_bias

KINDS = ("hit_query", "io", "sync", "backup")


def test_the_highest_priority_thread_runs_until_a_change_point_drops_it() -> None:
    bias = PctBias(seed=7, kinds=KINDS)
    first = max(KINDS, key=lambda kind: bias.priority[kind])
    change = min(bias.changes)
    picks = [bias.pick(KINDS) for _ in range(change)]
    assert picks == [first] * change  # the same thread, step after step
    assert bias.pick(KINDS) != first  # its priority fell below every other at the change point
    assert bias.changed == 1 and len(bias.changes) == PCT_DEPTH - 1


def test_a_case_picks_the_same_threads_again_from_its_seed() -> None:
    runs = [[PctBias(seed=3, kinds=KINDS).pick(KINDS[i % 3 :]) for i in range(50)] for _ in "ab"]
    assert runs[0] == runs[1]


def test_only_the_campaign_profile_biases_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_PROFILE", "ci")
    assert campaign_bias(0, KINDS) is None
    monkeypatch.setenv("HICACHE_PROFILE", "campaign")
    assert isinstance(campaign_bias(0, KINDS), PctBias)


def test_a_failing_case_says_which_depth_and_which_priority_changes_found_it() -> None:
    bias = PctBias(seed=7, kinds=KINDS)
    change = min(bias.changes)
    for _ in range(change + 1):
        bias.pick(KINDS)
    said = bias.describe()
    assert said == {"depth": PCT_DEPTH, "changes": 1, "changed_at": [change], "picks": change + 1}
    assert render_pct(said) == (
        f"found under PCT depth {PCT_DEPTH}: 1 of {PCT_DEPTH - 1} priority change(s) "
        f"(at picks {change} of {change + 1})"
    )


def test_the_campaign_profile_turns_pct_on_for_its_machine_without_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hicache-fuzz run --profile campaign`` biases its storage threads (the environment
    says nothing), and its report names the PCT depth of the failure it found."""
    monkeypatch.delenv("HICACHE_PROFILE", raising=False)
    report = run_campaign(
        "mutant:io_ignores_termination",
        seconds=60,
        profile="campaign",
        seed=0,
        out_dir=tmp_path,
        minimize_replays=0,
        shrink=False,
        progress=False,
    )
    assert report.failures, "io_ignores_termination survived a campaign under PCT"
    pct = report.failures[0]["pct"]
    assert pct["depth"] == PCT_DEPTH and 0 <= pct["changes"] <= PCT_DEPTH - 1
    assert "found under PCT depth" in render_summary(report)
