"""The case budget: ``--max-cases N`` ends a campaign after N cases, whatever the host's load.

A time budget measures the host as much as the implementation; a case budget runs the same cases
for a fixed seed and profile on a busy host as on an idle one (``campaign/budgets.py``). The
PP gate's share of a gate's cases is in ``tests/harness/test_sglang_pp_storage.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache_ref import cli
from hicache_ref.campaign.budgets import split_cases
from hicache_ref.errors import HiCacheInputError

WALL_CAP = "600"
"""A cap the case budget ends the run long before (each run here takes seconds)."""


def run_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, dict[str, Any], str]:
    """``hicache-fuzz run FLAGS --workers 1 --json``: (exit status, report, stdout)."""
    report = tmp_path / "run.json"
    argv = ["run", *flags, "--out", str(tmp_path), "--json", str(report), "--no-progress"]
    status = cli.main([*argv, "--workers", "1"])
    return status, json.loads(report.read_text()), capsys.readouterr().out


def test_a_run_stops_at_its_case_budget_long_before_its_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --max-cases 12 under a 600 s budget -> 12 cases (mid-round: a round is 10), exit 0
    status, report, out = run_json(tmp_path, capsys, "--budget", WALL_CAP, "--max-cases", "12")
    assert status == 0, out
    assert report["cases"] == 12 and report["cases_max"] == 12 and report["rounds"] == 2
    assert report["seconds"] < float(WALL_CAP) / 4, report["seconds"]
    # the summary says which budget ended it
    assert "  case budget: --max-cases 12 per worker, reached by 1 of 1 worker(s)" in out


def test_the_time_still_ends_a_run_whose_case_budget_it_does_not_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a 1 s budget and 100000 cases -> the time ends it; the summary says the cases did not
    status, report, out = run_json(tmp_path, capsys, "--budget", "1", "--max-cases", "100000")
    assert status == 0, out
    assert 0 < report["cases"] < 100000 and report["cases_max"] == 100000
    assert "reached by 0 of 1 worker(s)" in out


def test_one_seed_under_a_case_budget_runs_the_same_cases_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the same seed, profile and case budget twice -> the same cases, step for step
    first = run_json(tmp_path / "a", capsys, "--budget", WALL_CAP, "--max-cases", "15")[1]
    second = run_json(tmp_path / "b", capsys, "--budget", WALL_CAP, "--max-cases", "15")[1]
    assert first["cases"] == second["cases"] == 15
    assert (first["steps"], first["rules"]) == (second["steps"], second["rules"])
    assert first["configs"].keys() == second["configs"].keys()


def test_each_worker_of_a_fleet_runs_its_own_case_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two workers, --max-cases 5 -> 5 cases each on its own seeds, 10 in the merged report
    report = tmp_path / "run.json"
    argv = ["run", "--budget", WALL_CAP, "--max-cases", "5", "--workers", "2", "--no-progress"]
    assert cli.main([*argv, "--out", str(tmp_path), "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert [part["cases"] for part in data["parts"]] == [5, 5]
    assert data["cases"] == 10 and data["cases_max"] == 5
    assert (
        "case budget: --max-cases 5 per worker, reached by 2 of 2 worker(s)"
        in capsys.readouterr().out
    )


def test_no_case_budget_is_the_time_alone() -> None:
    assert cli.parse_args(["gate"]).max_cases is None
    assert cli.parse_args(["run", "--max-cases", "400"]).max_cases == 400


def test_a_gate_with_a_pp_share_splits_its_cases_as_it_splits_its_time() -> None:
    # 400 cases, a fifth to the PP gate -> 320 and 80; no PP share -> all to the state machine
    assert split_cases(400, 0.2) == (320, 80)
    assert split_cases(400, 0.0) == (400, None)
    assert split_cases(None, 0.2) == (None, None)
    # each part at least one case
    assert split_cases(1, 0.2) == (1, 1)
    with pytest.raises(HiCacheInputError, match="--max-cases 0 is not positive"):
        split_cases(0, 0.2)


def test_a_mutant_catalogue_row_stops_at_its_case_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the slowest mutant at seed 0 falls at case 247; --max-cases 3 ends its search at 3 cases,
    # long before the time, and the row says MISSED with the cases it ran (exit 1)
    report = tmp_path / "mutants.json"
    argv = ["mutants", "cancel_without_write_sync", "--budget", WALL_CAP, "--max-cases", "3"]
    status = cli.main([*argv, "--jobs", "1", "--out", str(tmp_path), "--json", str(report)])
    out = capsys.readouterr().out
    assert status == 1, out
    data = json.loads(report.read_text())
    assert data["cases_per_mutant_max"] == 3 and data["missed"] == ["cancel_without_write_sync"]
    (row,) = data["rows"]
    assert row["cases"] == 3 and row["campaign_seconds"] < float(WALL_CAP) / 4
    assert f"up to {WALL_CAP}s or 3 cases each" in out
