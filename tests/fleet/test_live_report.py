"""The live page: written at once, rewritten from the workers' reports so far while the
campaign runs (the browser reloads it), and once more at the end with the verdict and no
reload."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_ref import cli
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.fleet.live_report import LiveReport
from hicache_ref.fleet.merge import get_leaves, read_reports

REFRESH = re.compile(r'<meta http-equiv="refresh" content="(\d+)">')


def test_the_page_reloads_while_running_and_ends_with_the_verdict(
    two_shards: list[Path], tmp_path: Path
) -> None:
    page = tmp_path / "live.html"
    live = LiveReport(page, every_s=0.001)
    # start: a page at once, nothing ran yet
    live.start("mutant:skip_load_fence", "ci", 0)
    first = page.read_text()
    assert REFRESH.search(first) is not None and "RUNNING" in first
    assert "The campaign is starting: no case has finished yet." in first
    # two workers' reports so far: one page of both
    one, other = read_reports(two_shards)
    live.update(0, {**one.as_json(), "seconds": 1.0})
    live.update(1, {**other.as_json(), "seconds": 1.0})
    running = page.read_text()
    assert REFRESH.search(running) is not None
    assert f"{one.steps + other.steps:,}</div>" in running
    # finish: the verdict, and no more reloading
    live.finish(one)
    final = page.read_text()
    assert REFRESH.search(final) is None and "FAILED" in final
    assert live.pages == 4
    assert not list(tmp_path.glob(".*partial"))  # each page replaced the last whole


@pytest.mark.parametrize("workers", [1, 2])
def test_run_report_live_rewrites_the_page_as_the_workers_go(
    workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages: list[tuple[bool, int]] = []  # (reloading, workers on the page) of every page written
    write = LiveReport._write

    def spy(self: LiveReport, report: CampaignReport, *, refresh: bool) -> None:
        pages.append((refresh, len(get_leaves(report))))
        write(self, report, refresh=refresh)

    monkeypatch.setattr(LiveReport, "_write", spy)
    page = tmp_path / "live.html"
    argv = ["run", "--budget", "2", "--workers", str(workers), "--no-progress"]
    argv += ["--out", str(tmp_path), "--report-live", str(page), "--report-every", "0.3"]
    assert cli.main(argv) == 0
    # the first page at once, then pages of the reports so far (after cases, not rounds; a
    # spawned worker sends its own and the page merges the latest of each that arrived), then
    # the final one of every worker
    assert pages[0] == (True, 1) and pages[-1] == (False, workers)
    assert pages[1:-1] and all(reloading for reloading, _ in pages[1:-1])
    final = page.read_text()
    assert REFRESH.search(final) is None
    assert "PASSED · no new failure" in final and 'id="rule-write"' in final


def test_report_every_must_be_positive(tmp_path: Path) -> None:
    argv = ["run", "--budget", "1", "--workers", "1", "--no-progress", "--out", str(tmp_path)]
    argv += ["--report-live", str(tmp_path / "p.html"), "--report-every", "0"]
    assert cli.main(argv) == 2


def test_a_fleet_that_ends_without_a_report_leaves_no_running_page(tmp_path: Path) -> None:
    page = tmp_path / "live.html"
    live = LiveReport(page, every_s=10.0)
    live.start("reference", "ci", 0)
    live.abandon()  # a worker crashed: the page stops reloading and says so
    final = page.read_text()
    assert REFRESH.search(final) is None and "INTERRUPTED" in final
