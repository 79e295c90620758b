"""``hicache-fuzz report RUN.json... -o report.html``: one page for a whole campaign.

The page merges every worker report it is given (the JSON of ``run``/``gate --json``, of one
runner or of many: each shard's file) and shows, top to bottom: the verdict; cards with the
numbers that say whether the campaign is still learning (the time since its last new
behaviour first, ``behaviours.get_last_new``; coverage of the implementation under test; steps,
cases, invariant ids, configurations); each new failure with its replay line and minimal
failing program (``report_failures.py``); the charts (``plots.py``, inline SVG); then the
drill-downs (``report_tables.py``): rules, invariants, coverage by file, configurations,
workers. The page is one file that opens anywhere (a CI artifact, a mail attachment);
``live_report.py`` rewrites it while a campaign runs, with ``refresh_s`` set so the browser
reloads it.
"""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone
from pathlib import Path

from hicache_ref.campaign.behaviours import get_last_new
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.fleet.merge import get_leaves, merge_reports, read_reports
from hicache_ref.fleet.plots import get_coverage_percent, render_charts
from hicache_ref.fleet.report_failures import render_failures
from hicache_ref.fleet.report_style import SCRIPT, STYLE
from hicache_ref.fleet.report_tables import (
    configs_table,
    coverage_table,
    invariants_table,
    rules_table,
    workers_table,
)
from hicache_ref.invariant_titles import INVARIANT_TITLES


def write_report(json_paths: list[Path], output: Path) -> CampaignReport:
    """Read, merge, render and write the page; the merged report is returned."""
    merged = merge_reports(read_reports(json_paths))
    write_page(output, render_html(merged, [str(path) for path in json_paths]))
    return merged


def write_page(output: Path, page: str) -> None:
    """Replace ``output`` whole (a browser reloading it never reads half a page)."""
    partial = output.with_name(f".{output.name}.partial")
    partial.write_text(page)
    os.replace(partial, output)


def render_html(merged: CampaignReport, sources: list[str], *, refresh_s: int | None = None) -> str:
    """The page for ``merged`` (its ``parts`` are the workers); ``refresh_s``: a campaign still
    running, whose page the browser reloads that often."""
    if refresh_s and not merged.cases:  # a live page before any worker's first case
        charts = {"waiting": f'<p class="quiet">The campaign is starting: no case has finished '
                  f"yet. This page reloads every {refresh_s} s.</p>"}  # fmt: skip
    else:
        charts = render_charts(merged)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    origin = f"{len(sources)} report file(s): {', '.join(sources)}" if sources else "live"
    body = [
        _header(merged, refresh_s),
        _cards(merged, refresh_s),
        render_failures(merged),
        '<section id="charts"><h2>Over the campaign</h2><div class="charts">',
        *charts.values(),
        "</div></section>",
        rules_table(merged),
        invariants_table(merged),
        coverage_table(merged),
        configs_table(merged),
        workers_table(merged),
        f"<footer>{_e(origin)}; rendered {stamp}</footer>",
    ]
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{refresh}<title>hicache-fuzz: {_e(merged.implementation)}</title>"
        f"<style>{STYLE}</style><script>{SCRIPT}</script></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _e(text: object) -> str:
    return html.escape(str(text))


def _verdict(merged: CampaignReport, refresh_s: int | None) -> tuple[str, str]:
    if refresh_s:
        return "bad" if merged.failures else "live", f"RUNNING · page reloads every {refresh_s} s"
    if merged.failures:
        return "bad", f"FAILED · {len(merged.failures)} new failure(s)"
    if merged.interrupted:
        return "warn", "INTERRUPTED · no new failure in what ran"
    return "ok", "PASSED · no new failure"


def _header(merged: CampaignReport, refresh_s: int | None) -> str:
    css, verdict = _verdict(merged, refresh_s)
    if merged.failures and refresh_s:
        verdict += f" · {len(merged.failures)} new failure(s)"
    seeds = (f"seeds {merged.seed} + k" if merged.seed_stride == 1
             else f"seeds {merged.seed} + k*{merged.seed_stride}")  # fmt: skip
    workers = len(get_leaves(merged))
    facts = [
        f"on {merged.device_label}",
        f"profile {merged.profile}",
        seeds,
        f"{workers} worker(s), "
        + (merged.shard if "shards" in merged.shard else f"shard {merged.shard}"),
    ]
    if merged.database:
        facts.append(f"database {merged.database}")
    known = ", ".join(f"{k} x{v}" for k, v in sorted(merged.known_hits.items()))
    if known:
        facts.append(f"known findings hit: {known}")
    return (
        f'<header><div><h1>hicache-fuzz <span class="impl">{_e(merged.implementation)}</span>'
        f'</h1><div class="sub">{_e(" · ".join(facts))}</div></div>'
        f'<div class="verdict {css}">{_e(verdict)}</div></header>'
    )


def _card(label: str, value: str, detail: str = "", css: str = "") -> str:
    return (
        f'<div class="card {css}"><div class="label">{_e(label)}</div>'
        f'<div class="value">{_e(value)}</div><div class="detail">{_e(detail)}</div></div>'
    )


def _cards(merged: CampaignReport, refresh_s: int | None) -> str:
    last = get_last_new(merged.behaviours, merged.coverage)
    if last is None:
        since = _card("since the last new behaviour", "-", "nothing ran yet", "lead")
    else:
        quiet_s = max(0.0, merged.seconds - last.at_s)
        ended = "now" if refresh_s else "the end"
        since = _card("since the last new behaviour", _duration(quiet_s),
                      f"{last.what}, at {last.at_s:.1f} s; {ended} is {merged.seconds:.1f} s",
                      "lead")  # fmt: skip
    rate = merged.steps / merged.seconds if merged.seconds else 0.0
    lines = get_coverage_percent(merged.coverage, "lines")
    branches = get_coverage_percent(merged.coverage, "arcs")
    checked = sum(1 for inv_id in INVARIANT_TITLES if merged.checks_by_id.get(inv_id))
    cards = [
        since,
        _card("line coverage", "-" if lines is None else f"{lines:.1f}%",
              "of the implementation under test" if lines is not None else "run with --coverage"),
        _card("branch coverage", "-" if branches is None else f"{branches:.1f}%",
              f"{len(merged.coverage.get('files', {}))} files" if branches is not None else ""),
        _card("time", _duration(merged.seconds), f"{len(get_leaves(merged))} worker(s)"
              + (", interrupted" if merged.interrupted else "")),
        _card("steps", f"{merged.steps:,}", f"{rate:,.0f} steps/s, {merged.skipped_steps:,} skipped"),
        _card("cases", f"{merged.cases:,}", f"{merged.rounds:,} rounds"),
        _card("invariant ids checked", f"{checked} / {len(INVARIANT_TITLES)}",
              f"{merged.invariant_checks:,} checks"),
        _card("configurations", f"{len(merged.configs):,}", "distinct, drawn"),
        _card("new failures", str(len(merged.failures)),
              f"{sum(merged.repeats.values())} repeat(s), {sum(merged.known_hits.values())} known",
              "bad" if merged.failures else "good"),
    ]  # fmt: skip
    return '<section class="cards">' + "".join(cards) + "</section>"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
