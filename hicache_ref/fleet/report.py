"""``hicache-fuzz report RUN.json... -o report.html``: one static page for a whole campaign.

The page merges every worker report it is given (the JSON of ``run``/``gate --json``, of one
runner or of many: each shard's file), and shows, in order: what ran (implementations, device,
profile, seeds, shards, workers, time, cases, steps), the failures with their replay lines, the
plots (``plots.py``: steps, cases, configurations and invariant ids over time, rule families,
checks by id), every invariant id of the spec with its title, its checks and when it was first
checked, the configuration features drawn, and one row per worker. Images are embedded PNGs:
the page is one file that opens anywhere (a CI artifact, a mail attachment).
"""

from __future__ import annotations

import html
from datetime import datetime, timezone
from pathlib import Path

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.fleet.merge import get_leaves, merge_reports, read_reports
from hicache_ref.fleet.plots import render_plots
from hicache_ref.invariant_titles import INVARIANT_TITLES, get_invariant_label

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1320px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f6f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; background: #f4f6f8; padding: 1px 4px; word-break: break-all; }
.plots { display: grid; grid-template-columns: repeat(2, 1fr); gap: 12px; }
.plots img { width: 100%; border: 1px solid #eee; }
.bad { color: #c0392b; font-weight: 600; } .ok { color: #1e8449; font-weight: 600; }
tr.unchecked td { background: #fdecea; }
"""


def write_report(json_paths: list[Path], output: Path) -> CampaignReport:
    """Read, merge, render and write the page; the merged report is returned."""
    reports = read_reports(json_paths)
    merged = merge_reports(reports)
    output.write_text(render_html(merged, [str(path) for path in json_paths]))
    return merged


def render_html(merged: CampaignReport, sources: list[str]) -> str:
    """The page for ``merged`` (its ``parts`` are the workers), built from ``sources``."""
    plots = render_plots(merged)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [
        "<h1>hicache-fuzz campaign report</h1>",
        f'<div class="sub">{len(sources)} report file(s): {_e(", ".join(sources))}; '
        f"rendered {stamp}</div>",
        _summary(merged),
        _failures(merged),
        "<h2>Over the campaign</h2>",
        '<div class="plots">',
        *(
            f'<img alt="{name}" src="data:image/png;base64,{png}">'
            for name, png in plots.items()
            if name != "checks"
        ),
        "</div>",
        "<h2>Invariants</h2>",
        '<div class="plots">',
        f'<img alt="checks" src="data:image/png;base64,{plots["checks"]}">',
        _invariants(merged),
        "</div>",
        _features(merged),
        _workers(merged),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>hicache-fuzz report: {_e(merged.implementation)}</title>"
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(header: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    lines = []
    for i, row in enumerate(rows):
        css = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        lines.append(f"<tr{css}>" + "".join(row) + "</tr>")
    return f"<table><tr>{head}</tr>" + "".join(lines) + "</table>"


def _cell(value: object, *, num: bool = False) -> str:
    return f'<td class="num">{_e(value)}</td>' if num else f"<td>{_e(value)}</td>"


def _summary(merged: CampaignReport) -> str:
    verdict = (
        f'<span class="bad">{len(merged.failures)} new failure(s)</span>'
        if merged.failures
        else '<span class="ok">no new failure</span>'
    )
    rate = merged.steps / merged.seconds if merged.seconds else 0.0
    known = ", ".join(f"{k} x{v}" for k, v in sorted(merged.known_hits.items())) or "none"
    rows = [
        ("verdict", verdict),
        ("implementation", _e(merged.implementation)),
        ("device", _e(merged.device_label)),
        ("profile", _e(merged.profile)),
        ("seeds", _e(_seeds(merged))),
        ("workers / shard", _e(f"{len(get_leaves(merged))} / {merged.shard}")),
        ("database", _e(merged.database or "none")),
        ("time", _e(f"{merged.seconds:.1f} s" + (" (interrupted)" if merged.interrupted else ""))),
        ("cases / rounds", _e(f"{merged.cases:,} / {merged.rounds:,}")),
        ("steps", _e(f"{merged.steps:,} ({rate:,.0f} steps/s, {merged.skipped_steps:,} skipped)")),
        ("invariant checks", _e(f"{merged.invariant_checks:,}")),
        ("distinct configurations", _e(f"{len(merged.configs):,}")),
        ("lockstep oracle", _e(f"{merged.lockstep_cases:,} cases, {merged.lockstep_steps:,} steps")),
        ("known findings hit", _e(known)),
    ]  # fmt: skip
    return _table(["", ""], [[f"<th>{_e(k)}</th>", f"<td>{v}</td>"] for k, v in rows])


def _seeds(report: CampaignReport) -> str:
    if report.seed_stride == 1:
        return f"{report.seed}, {report.seed + 1}, {report.seed + 2}, ... (one per round)"
    step = report.seed_stride
    return f"{report.seed}, {report.seed + step}, {report.seed + 2 * step}, ... (stride {step})"


def _failures(merged: CampaignReport) -> str:
    if not merged.failures:
        return "<h2>Failures</h2><p>None new in this campaign.</p>"
    rows = []
    for failure in merged.failures:
        again = merged.repeats[failure["invariant"]]
        rows.append(
            [
                _cell(get_invariant_label(failure["invariant"])),
                _cell(f"{failure.get('worker', '-')} ({failure.get('shard', '1/1')})"),
                _cell(failure["seed"], num=True),
                _cell(failure.get("found_at_s", "-"), num=True),
                _cell(failure.get("steps", "-"), num=True),
                _cell(again, num=True),
                _cell(failure["error"]),
                f"<td><code>{_e(failure.get('replay', ''))}</code></td>",
            ]
        )
    header = [
        "invariant",
        "worker (shard)",
        "seed",
        "found at s",
        "steps",
        "repeats",
        "error",
        "replay",
    ]
    return "<h2>Failures</h2>" + _table(header, rows)


def _invariants(merged: CampaignReport) -> str:
    ids = sorted(set(INVARIANT_TITLES) | set(merged.checks_by_id))
    rows, classes = [], []
    for inv_id in ids:
        checks = merged.checks_by_id.get(inv_id, 0)
        first = merged.checks_first_s.get(inv_id)
        rows.append(
            [
                _cell(inv_id),
                _cell(INVARIANT_TITLES.get(inv_id, "(not in the spec)")),
                _cell(f"{checks:,}", num=True),
                _cell("never" if first is None else f"{first:.1f}", num=True),
            ]
        )
        classes.append("" if checks else "unchecked")
    return _table(["id", "title", "checks", "first checked at s"], rows, classes)


def _features(merged: CampaignReport) -> str:
    rows = [
        [_cell(name), _cell(", ".join(f"{value}={count}" for value, count in sorted(c.items())))]
        for name, c in merged.features.items()
    ]
    families = [
        [_cell(family), _cell(f"{share:.1%}", num=True), _cell(merged.families[family], num=True)]
        for family, share in merged.family_shares().items()
    ]
    return (
        "<h2>Configurations drawn</h2>"
        + _table(["feature", "cases by value"], rows)
        + "<h2>Rule families</h2>"
        + _table(["family", "share of applied steps", "steps"], families)
    )


def _workers(merged: CampaignReport) -> str:
    rows = []
    for leaf in get_leaves(merged):
        rate = leaf.steps / leaf.seconds if leaf.seconds else 0.0
        rows.append(
            [
                _cell(leaf.worker, num=True),
                _cell(leaf.shard),
                _cell(_seeds(leaf)),
                _cell(f"{leaf.seconds:.1f}", num=True),
                _cell(f"{leaf.cases:,}", num=True),
                _cell(f"{leaf.steps:,}", num=True),
                _cell(f"{rate:,.0f}", num=True),
                _cell(len(leaf.failures), num=True),
                _cell("yes" if leaf.interrupted else "no"),
            ]
        )
    header = [
        "worker",
        "shard",
        "seeds",
        "s",
        "cases",
        "steps",
        "steps/s",
        "failures",
        "interrupted",
    ]
    return "<h2>Workers</h2>" + _table(header, rows)
