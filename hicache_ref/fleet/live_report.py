"""The report's page while a campaign runs: ``run --report-live report.html --report-every 10``.

A static file, rewritten whole every ``every_s`` seconds (``report.write_page``: a browser
never reads half of it), whose ``<meta http-equiv="refresh">`` makes the browser reload it as
often; the last page, written when the campaign ends, has no refresh and the final verdict.

In the order a fleet's campaign drives it (``workers.run_fleet``):

- ``start``: a first page at once (nothing ran yet), so the file is there to open;
- ``on_case``: a campaign in this process (one worker) renders its own report when due;
- ``update``: a spawned worker sends its report so far (``as_json``) every ``every_s``; the
  page merges the latest of each worker (``merge.py``), as the final report will;

Both run after a case (``run_campaign(on_case=...)``), not after a round: a round of the
``campaign`` profile can last longer than the page's period.
- ``finish``: the merged final report, without the refresh (``abandon``: the fleet ended
  without one, a worker's crash or a setup error: what the workers sent, as interrupted).

Rendering is milliseconds of string building (the charts are SVG text), so a campaign in this
process loses about that every ``every_s`` seconds.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.fleet.merge import merge_reports, report_from_json
from hicache_ref.fleet.report import render_html, write_page

REPORT_EVERY_S_DEFAULT = 10.0


def open_live_report(
    path: str, every_s: float, impl: str, profile: str, seed: int
) -> LiveReport | None:
    """The fleet's live page (None without a path), its first page written."""
    if not path:
        return None
    live = LiveReport(Path(path), every_s)
    live.start(impl, profile, seed)
    return live


class LiveReport:
    """One page, rewritten as the campaign goes."""

    def __init__(self, path: Path, every_s: float = REPORT_EVERY_S_DEFAULT) -> None:
        assert every_s > 0, f"every_s must be positive, got {every_s}"
        self.path = path
        self.every_s = every_s
        self.latest: dict[int, dict[str, Any]] = {}
        self.pages = 0
        self._due_at = time.monotonic() + every_s

    @property
    def refresh_s(self) -> int:
        return max(1, math.ceil(self.every_s))

    def start(self, impl: str, profile: str, seed: int) -> None:
        self._write(CampaignReport(impl, profile, seed), refresh=True)

    def on_case(self, report: CampaignReport, elapsed_s: float) -> None:
        """A campaign in this process: its report so far, when a page is due."""
        if self._is_due():
            so_far = report_from_json(report.as_json())
            so_far.seconds = elapsed_s  # a running campaign's report has no length yet
            self._write(so_far, refresh=True)

    def update(self, worker: int, data: dict[str, Any]) -> None:
        """A worker's report so far (its ``as_json``, ``seconds`` the time it has run): kept,
        and the page rewritten when due."""
        self.latest[worker] = data
        if self._is_due():
            parts = [report_from_json(self.latest[w]) for w in sorted(self.latest)]
            self._write(merge_reports(parts), refresh=True)

    def finish(self, merged: CampaignReport) -> None:
        self._write(merged, refresh=False)

    def abandon(self) -> None:
        parts = [report_from_json(self.latest[w]) for w in sorted(self.latest)]
        so_far = merge_reports(parts) if parts else CampaignReport("-", "-", 0)
        so_far.interrupted = True
        self._write(so_far, refresh=False)

    def _is_due(self) -> bool:
        now = time.monotonic()
        if now < self._due_at:
            return False
        self._due_at = now + self.every_s
        return True

    def _write(self, report: CampaignReport, *, refresh: bool) -> None:
        page = render_html(report, [], refresh_s=self.refresh_s if refresh else None)
        write_page(self.path, page)
        self.pages += 1
