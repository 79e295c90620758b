"""``hicache-fuzz report``: the page of a real (short) campaign run as two shards.

Two runners (``--shard 1/2`` and ``2/2``, ``conftest.two_shards``) fuzz a mutant for a moment
with coverage on and write their JSON; the report merges them into one page: the verdict and
the cards, each failure with its replay line (whole, never broken inside a word) and its
minimal failing program, the charts as inline SVG (coverage first), a row per rule with the
counts the terminal summary prints, every invariant id of the spec with its title, and
coverage by file.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from hicache_ref import cli
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.fleet.merge import merge_reports, read_reports
from hicache_ref.fleet.plots import get_coverage_percent, get_summed_timeline
from hicache_ref.fleet.report import render_html
from hicache_ref.fleet.report_failures import get_program
from hicache_ref.invariant_titles import INVARIANT_TITLES, get_invariant_label

CHARTS = (
    "coverage of the implementation under test",
    "behaviours first seen",
    "protocol steps applied",
    "configurations drawn",
    "rule families: share of the steps in each slice of time",
)


def test_the_report_of_two_shards_shows_failures_charts_rules_and_invariants(
    two_shards: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page_path = tmp_path / "report.html"
    assert cli.main(["report", *map(str, two_shards), "-o", str(page_path)]) == 0
    assert f"report: {page_path} (2 file(s), 2 worker(s)" in capsys.readouterr().out
    page = page_path.read_text()
    merged = merge_reports(read_reports(two_shards))
    # the verdict, and the charts as inline SVG, coverage first
    assert f"FAILED · {len(merged.failures)} new failure(s)" in page
    labels = re.findall(r'<svg viewBox="[^"]+" role="img" aria-label="([^"]+)"', page)
    assert labels == [html.escape(title) for title in CHARTS]
    assert "<img" not in page  # nothing to fetch, nothing rasterized
    # each failure: its invariant, its replay line whole, its program step by step
    assert merged.failures
    for failure in merged.failures:
        assert f"<h3>{html.escape(get_invariant_label(failure['invariant']))}</h3>" in page
        assert f"<pre>{html.escape(failure['replay'])}</pre>" in page
        config, steps = get_program(failure)
        assert steps and len(steps) == int(failure["steps"])
        assert f'<div class="config">{html.escape(config)}</div>' in page
        for number, step in enumerate(steps, 1):
            assert f'<li value="{number}"><code>{html.escape(step)}</code></li>' in page
    # a row per rule applied, with the count the terminal summary prints
    for rule, count in merged.rules.items():
        row = re.search(rf'<tr id="rule-{rule}">(.*?)</tr>', page)
        assert row is not None, rule
        assert f"<span>{count:,}</span>" in row.group(1)
    # every invariant id of the spec with its title
    for inv_id, title in INVARIANT_TITLES.items():
        assert f'<td class="mono">{inv_id}</td><td>{html.escape(title)}</td>' in page
    assert "2 worker(s), 2 shards" in page


def test_coverage_is_the_union_of_the_workers(two_shards: list[Path]) -> None:
    one, other = read_reports(two_shards)
    merged = merge_reports([one, other])
    # each worker's timeline records its covered lines and branches as it ran
    for report in (one, other):
        assert all("lines" in point and "branches" in point for point in report.timeline)
        assert report.timeline[-1]["lines"] == sum(
            len(seen["lines"]) for seen in report.coverage["files"].values()
        )
    # merged: a line either worker covered counts once, first seen by the earlier
    name = "hicache_ref/controller/cache_controller.py"
    lines = {**other.coverage["files"][name]["lines"], **one.coverage["files"][name]["lines"]}
    assert merged.coverage["files"][name]["lines"].keys() == lines.keys()
    for line, at_s in merged.coverage["files"][name]["lines"].items():
        seen = [r.coverage["files"][name]["lines"].get(line) for r in (one, other)]
        assert at_s == min(t for t in seen if t is not None)
    merged_lines = get_coverage_percent(merged.coverage, "lines")
    assert merged_lines is not None
    for report in (one, other):
        assert get_coverage_percent(report.coverage, "lines") <= merged_lines <= 100  # type: ignore[operator]


def test_the_fleet_timeline_interpolates_each_worker_between_its_samples() -> None:
    # worker A samples at 0, 1, 2; worker B at 0, 1.5: their sum never jumps back or ahead
    one, other = CampaignReport("reference", "ci", 0), CampaignReport("reference", "ci", 1)
    one.timeline = [{"t": 0.0, "steps": 0}, {"t": 1.0, "steps": 100}, {"t": 2.0, "steps": 200}]
    other.timeline = [{"t": 0.0, "steps": 0}, {"t": 1.5, "steps": 300}]
    grid, totals = get_summed_timeline([one, other], lambda point: float(point["steps"]))
    assert grid == [0.0, 1.0, 1.5, 2.0]
    # at 1.0 B is two thirds of the way to 300; at 2.0 B has ended and holds its last count
    assert totals == [0.0, 100.0 + 200.0, 150.0 + 300.0, 200.0 + 300.0]


def test_the_page_of_a_campaign_without_coverage_says_how_to_get_it(two_shards: list[Path]) -> None:
    report = read_reports(two_shards[:1])[0]
    report.coverage = {}
    page = render_html(report, ["one.json"])
    assert "Not measured: run with <code>--coverage</code>" in page
    assert 'aria-label="coverage of the implementation under test"' not in page  # no empty plot
