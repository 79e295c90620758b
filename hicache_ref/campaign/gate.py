"""The gate's verdict over a campaign's report: the known findings it baselines, the new
failures with their replay lines, and its exit status and JSON.

In the order ``hicache-fuzz gate`` uses them: ``get_gate_known`` (``--known``: by default every
finding written up for the implementation gated), then, once the campaign ran,
``render_gate`` (the known findings on one folded line, then each new failure and the line that
replays it), ``gate_json`` (the verdict for ``--json``) and ``get_exit_status`` (0, 1, or 130
when a signal cut it short). The verdict line itself is ``summary.render_verdict``.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.campaign.interrupts import EXIT_INTERRUPTED
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.summary import render_pct, wrap_items
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.campaigns.known_findings import ALL, KnownFinding, get_known_findings
from hicache_ref.replay_lines import get_replay_line, get_rerun_line

EXIT_OK, EXIT_FAILED = 0, 1
KNOWN_NONE = "none"


def get_exit_status(report: CampaignReport) -> int:
    """130 when Ctrl-C ended it, else 1 on a new failure, else 0."""
    if report.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if report.failures else EXIT_OK


def get_gate_known(ids: list[str] | None, implementation: str) -> tuple[KnownFinding, ...]:
    """``--known``: by default every finding written up for ``implementation`` (a gate passes
    the release it gates against); ``none`` counts nothing, so every failure shows."""
    if ids is None:
        return get_known_findings([ALL], implementation)
    if ids == [KNOWN_NONE]:
        return ()
    if KNOWN_NONE in ids:
        raise HiCacheInputError(f"--known {KNOWN_NONE} stands alone; drop the other ids")
    return get_known_findings(ids, implementation)


def render_gate(report: CampaignReport, known: tuple[KnownFinding, ...]) -> str:
    """The known findings on one folded line, then each new failure and its replay (the
    verdict, ``summary.render_verdict``, comes after the report's path)."""
    lines = render_known(report, known)
    for failure in report.failures:
        again = report.repeats[failure["invariant"]]
        more = f", {again} more like it" if again else ""
        steps = f", {failure['steps']} steps" if "steps" in failure else ""
        lines.append(
            f"gate: NEW {failure['invariant']} (seed {failure['seed']}{steps}{more}): "
            f"{failure['error']}"
        )
        if "pct" in failure:
            lines.append(f"  {render_pct(failure['pct'])}")
        if failure["trace"]:
            lines.append(get_replay_line(failure["trace"], report.implementation))
        else:  # it failed outside a step, so no trace exists: the seed reproduces it
            rerun = get_rerun_line(
                report.implementation,
                report.profile,
                int(failure["seed"]),
                report.device,
                report.source,
            )
            lines.append(f"  no trace; rerun: {rerun}")
    return "\n".join(lines)


def render_known(report: CampaignReport, known: tuple[KnownFinding, ...]) -> list[str]:
    """``gate: known findings: F8 (INV-07) hit x3; not hit: F1, F22 (scoped to ...)``, folded
    to the summary's width: the hits with their invariant, then the rest by id alone."""
    if not known:
        return []
    hit = [
        f"{f.id} ({f.invariant}) hit x{report.known_hits[f.id]}"
        for f in known
        if report.known_hits[f.id]
    ]
    missed = [_known_missed(report, f) for f in known if not report.known_hits[f.id]]
    if missed:
        missed[0] = f"not hit: {missed[0]}"
    return wrap_items("gate: known findings: ", [*hit, *missed])


def _known_missed(report: CampaignReport, finding: KnownFinding) -> str:
    if not finding.covers(report.implementation):
        return f"{finding.id} (names no {report.implementation!r})"
    if not finding.covers_release(report.release):
        return f"{finding.id} (scoped to {finding.releases})"
    return finding.id


def gate_json(report: CampaignReport, known: tuple[KnownFinding, ...]) -> dict[str, Any]:
    return {
        "passed": not report.failures and not report.interrupted,
        "verdict": "interrupted"
        if report.interrupted
        else "failed"
        if report.failures
        else "passed",
        "new_failures": len(report.failures),
        "known_selected": [finding.id for finding in known],
        "known_hits": dict(sorted(report.known_hits.items())),
        "known_not_hit": [f.id for f in known if not report.known_hits[f.id]],
    }
