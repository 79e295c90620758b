"""A CP world across processes (gloo on CPU): the reference passes bounded 2- and 4-rank
campaigns, every rank running the same cases and steps, and reaching the load path."""

from __future__ import annotations

from pathlib import Path

from hicache_ref.distributed.campaign import run_cp_campaign


def test_reference_passes_a_two_rank_campaign(tmp_path: Path) -> None:
    # 2 processes, 4 seeded cases of 60 drawn steps -> no failure, the same counts on each rank
    report = run_cp_campaign(
        "reference",
        processes=2,
        seconds=60,
        cases_max=4,
        steps_per_case=60,
        seed=0,
        out_dir=tmp_path,
        progress=False,
    )
    assert not report.failed, report.render()
    assert [r.cases for r in report.ranks] == [4, 4]
    assert report.ranks[0].steps == report.ranks[1].steps > 200
    rules = report.lead.rules
    for rule in ("write", "drain_acks", "evict_device", "load", "start_loading", "forward_read"):
        assert rules.get(rule, 0) > 0, f"{rule} never ran: {rules}"
    assert report.lead.checks_by_id["INV-14"] > 0
    assert not list(tmp_path.iterdir())  # no failure, no trace


def test_reference_passes_a_four_rank_campaign(tmp_path: Path) -> None:
    report = run_cp_campaign(
        "reference",
        processes=4,
        seconds=60,
        cases_max=2,
        steps_per_case=50,
        seed=1,
        out_dir=tmp_path,
        progress=False,
    )
    assert not report.failed, report.render()
    assert [r.cases for r in report.ranks] == [2, 2, 2, 2]
    assert len({r.steps for r in report.ranks}) == 1
