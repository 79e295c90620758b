"""The report's tables, each a drill-down of one thing the campaign counted.

``rules_table``: every rule applied, with its family, counts by outcome (done, refused,
skipped), its share of the steps and when it was first and last seen (the terminal summary's
``rules hit`` with their history); ``invariants_table``: every invariant id of the spec with
its title, checks, first and last checked, and its failures (a link to each card; unchecked
ids stand out); ``coverage_table``: each file of the implementation under test, statements and
branches covered; ``configs_table``: the configuration features drawn; ``workers_table``: one
row per worker.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from hicache_ref.campaign.behaviours import CHECK_PREFIX
from hicache_ref.campaign.report import CampaignReport, get_rule_family
from hicache_ref.fleet.merge import get_leaves
from hicache_ref.fleet.report_failures import get_failure_anchor
from hicache_ref.invariant_titles import INVARIANT_TITLES


def table(header: Sequence[str], rows: list[str], css: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return (
        f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def cell(value: object, *, num: bool = False, css: str = "") -> str:
    classes = " ".join(c for c in ("num" if num else "", css) if c)
    return f'<td class="{classes}">{_e(value)}</td>' if classes else f"<td>{_e(value)}</td>"


def bar(share: float, label: str, css: str = "") -> str:
    """A cell with a bar as long as ``share`` (0..1) behind ``label``."""
    width = max(0.0, min(share, 1.0)) * 100
    return (f'<td class="barcell {css}"><div class="bar" style="width:{width:.1f}%"></div>'
            f"<span>{_e(label)}</span></td>")  # fmt: skip


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def rules_table(merged: CampaignReport) -> str:
    behaviours = merged.behaviours
    names = sorted(set(behaviours.get_rules()) | set(merged.rules))
    applied_most = max(merged.rules.values(), default=0) or 1  # the longest bar: the top rule
    rows = []
    for rule in sorted(names, key=lambda r: (-merged.rules.get(r, 0), r)):
        seen = behaviours.get_rule(rule)
        applied = merged.rules.get(rule, 0)
        rows.append(
            f'<tr id="rule-{_e(rule)}">' + cell(rule, css="mono") + cell(get_rule_family(rule))
            + bar(applied / applied_most, f"{applied:,}", "num")
            + cell(f"{seen['done']:,}", num=True) + cell(f"{seen['refused']:,}", num=True)
            + cell(f"{seen['skipped']:,}", num=True)
            + cell(_seconds(seen["first_s"]), num=True) + cell(_seconds(seen["last_s"]), num=True)
            + "</tr>"
        )  # fmt: skip
    header = ["rule", "family", "applied", "done", "refused", "skipped (not enabled)",
              "first seen s", "last seen s"]  # fmt: skip
    return (f'<section id="rules"><h2>Rules <span class="count">{len(rows)}</span></h2>'
            + table(header, rows, "rules") + "</section>")  # fmt: skip


def invariants_table(merged: CampaignReport) -> str:
    ids = sorted(set(INVARIANT_TITLES) | set(merged.checks_by_id))
    top = math.log10(1 + max(merged.checks_by_id.values(), default=0)) or 1.0
    failed = {str(f["invariant"]) for f in merged.failures}
    rows = []
    for inv_id in ids:
        checks = merged.checks_by_id.get(inv_id, 0)
        last = merged.behaviours.last_s.get(CHECK_PREFIX + inv_id)
        first = merged.checks_first_s.get(
            inv_id, merged.behaviours.first_s.get(CHECK_PREFIX + inv_id)
        )
        if inv_id in failed:
            again = merged.repeats[inv_id]
            status = (f'<td><a class="bad" href="#{_e(get_failure_anchor(inv_id))}">FAILED'
                      f"{f' x{again + 1}' if again else ''}</a></td>")  # fmt: skip
        else:
            status = (
                '<td class="quiet">never checked</td>' if not checks else '<td class="ok">held</td>'
            )
        css = "unchecked" if not checks else ("failed" if inv_id in failed else "")
        rows.append(
            f'<tr class="{css}" id="inv-{_e(inv_id)}">' + cell(inv_id, css="mono")
            + cell(INVARIANT_TITLES.get(inv_id, "(not in the spec)"))
            + bar(math.log10(1 + checks) / top, f"{checks:,}", "num")
            + cell(_seconds(first), num=True) + cell(_seconds(last), num=True) + status + "</tr>"
        )  # fmt: skip
    checked = sum(1 for inv_id in ids if merged.checks_by_id.get(inv_id))
    header = ["id", "title", "checks (log bar)", "first checked s", "last checked s", "status"]
    return (f'<section id="invariants"><h2>Invariants <span class="count">{checked} of '
            f"{len(ids)} checked</span></h2>" + table(header, rows, "invariants")
            + "</section>")  # fmt: skip


def coverage_table(merged: CampaignReport) -> str:
    files = merged.coverage.get("files", {})
    if not files:
        return ""
    rows = []
    for name, seen in sorted(files.items(), key=lambda item: -item[1]["statements"]):
        if not seen["statements"]:
            continue
        lines, branches = len(seen["lines"]), len(seen["arcs"])
        line_share = lines / seen["statements"]
        branch_share = branches / seen["branches"] if seen["branches"] else 0.0
        branch_text = (
            f"{branch_share:.0%} ({branches}/{seen['branches']})"
            if seen["branches"]
            else "no branches"
        )
        last = max([*seen["lines"].values(), *seen["arcs"].values()], default=None)
        rows.append(
            "<tr>" + cell(name, css="mono")
            + bar(line_share, f"{line_share:.0%} ({lines}/{seen['statements']})", "num")
            + bar(branch_share, branch_text, "num")
            + cell(_seconds(last), num=True) + "</tr>"
        )  # fmt: skip
    header = ["file", "lines", "branches", "last new line or branch s"]
    core = merged.coverage.get("core", "")
    return (f'<section id="coverage-files"><h2>Coverage by file <span class="count">'
            f"{len(rows)} files, measured by coverage.py ({_e(core)})</span></h2>"
            + table(header, rows, "files") + "</section>")  # fmt: skip


def configs_table(merged: CampaignReport) -> str:
    rows = []
    for name, counts in merged.features.items():
        total = sum(counts.values()) or 1
        values = " ".join(
            f'<span class="chip">{_e(value)} <b>{count / total:.0%}</b></span>'
            for value, count in sorted(counts.items(), key=lambda item: -item[1])
        )
        rows.append("<tr>" + cell(name) + f"<td>{values}</td></tr>")
    return ('<section id="configs"><h2>Configurations drawn <span class="count">'
            f"{len(merged.configs):,} distinct</span></h2>"
            + table(["feature", "share of cases by value"], rows, "configs") + "</section>")  # fmt: skip


def workers_table(merged: CampaignReport) -> str:
    rows = []
    for leaf in get_leaves(merged):
        rate = leaf.steps / leaf.seconds if leaf.seconds else 0.0
        seeds = (
            f"{leaf.seed} + k*{leaf.seed_stride}" if leaf.seed_stride > 1 else f"{leaf.seed} + k"
        )
        rows.append(
            "<tr>" + cell(leaf.worker, num=True) + cell(leaf.shard) + cell(seeds, css="mono")
            + cell(f"{leaf.seconds:.1f}", num=True) + cell(f"{leaf.cases:,}", num=True)
            + cell(f"{leaf.steps:,}", num=True) + cell(f"{rate:,.0f}", num=True)
            + cell(len(leaf.failures), num=True) + cell("yes" if leaf.interrupted else "no")
            + "</tr>"
        )  # fmt: skip
    header = ["worker", "shard", "seeds (round k)", "s", "cases", "steps", "steps/s",
              "failures", "interrupted"]  # fmt: skip
    return '<section id="workers"><h2>Workers</h2>' + table(header, rows) + "</section>"


def _e(text: object) -> str:
    return html.escape(str(text))
