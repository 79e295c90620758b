"""Progress of a campaign or a fleet on stderr: a bar on a terminal, a line now and then in a log.

With stderr redirected (a CI log, ``2> run.log``) a redrawn bar would write every redraw into
the file, so there a ``ProgressView`` prints one plain line every ``interval_s`` instead
(long runs show they are alive; a short one prints none). Workers send a ``Snapshot`` after
their rounds, at most one a second (``fleet/workers.py``); the view sums the latest of each.
The bar is drawn from the first snapshot on, and a line said while it shows (``say``: the
command's header, "all workers running") clears it first, so a line never shares the bar's.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport

PROGRESS_LINE_INTERVAL_S = 30.0


@dataclass(frozen=True)
class Snapshot:
    """One worker's counts so far."""

    elapsed_s: float
    cases: int
    steps: int
    failures: int
    known: int


def get_snapshot(report: CampaignReport, elapsed_s: float) -> Snapshot:
    return Snapshot(
        elapsed_s=elapsed_s,
        cases=report.cases,
        steps=report.steps,
        failures=len(report.failures) + sum(report.repeats.values()),
        known=sum(report.known_hits.values()),
    )


class ProgressView:
    """The sum of the workers' latest snapshots, drawn on ``stream`` (default: stderr)."""

    def __init__(
        self,
        seconds: float,
        *,
        workers: int = 1,
        stream: TextIO | None = None,
        interval_s: float = PROGRESS_LINE_INTERVAL_S,
    ) -> None:
        self.seconds = seconds
        self.workers = workers
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.latest: dict[int, Snapshot] = {}
        self._next_line_at = time.monotonic() + interval_s
        self._bar: Any = None
        self._closed = False

    def on_round(self, report: CampaignReport, elapsed_s: float) -> None:
        """``run_campaign``'s callback for a campaign in this process."""
        self.update(0, get_snapshot(report, elapsed_s))

    def update(self, worker: int, snapshot: Snapshot) -> None:
        self.latest[worker] = snapshot
        total = self.total()
        if self._bar is None and not self._closed and _is_terminal(self.stream):
            self._bar = _make_bar(self.seconds, self.stream)
        if self._bar is not None:
            self._bar.n = min(self.seconds, round(total.elapsed_s, 1))
            postfix = {"cases": total.cases, "steps": total.steps, "failures": total.failures}
            if total.known:
                postfix["known"] = total.known
            self._bar.set_postfix(**postfix)
            self._bar.refresh()
        elif time.monotonic() >= self._next_line_at:
            self._next_line_at = time.monotonic() + self.interval_s
            print(self.render_line(), file=self.stream, flush=True)

    def total(self) -> Snapshot:
        snaps = list(self.latest.values())
        return Snapshot(
            elapsed_s=max((s.elapsed_s for s in snaps), default=0.0),
            cases=sum(s.cases for s in snaps),
            steps=sum(s.steps for s in snaps),
            failures=sum(s.failures for s in snaps),
            known=sum(s.known for s in snaps),
        )

    def render_line(self) -> str:
        total = self.total()
        fleet = f", {len(self.latest)}/{self.workers} workers" if self.workers > 1 else ""
        known = f", {total.known} known" if total.known else ""
        return (
            f"hicache-fuzz: {total.elapsed_s:.0f}/{self.seconds:.0f}s{fleet}, {total.cases} "
            f"cases, {total.steps} steps, {total.failures} failures{known}"
        )

    def say(self, line: str) -> None:
        """Print ``line`` on a line of its own (the bar, if drawn, clears and redraws under it)."""
        if self._bar is not None:
            self._bar.clear()
        print(line, file=self.stream, flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _make_bar(seconds: float, stream: TextIO) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; without it the campaign still runs
        return None
    return tqdm(
        total=seconds,
        unit="s",
        desc="fuzzing",
        file=stream,
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s{postfix}",  # tqdm puts ", " before it
    )
