"""The text summary of a campaign, as ``hicache-fuzz run`` and ``gate`` print it.

One header line (implementation and its own name, device, profile, seeds, workers, shard,
database), then the counts: cases and steps, rules and rule families, the configuration
features drawn, the copy path ``auto`` picked in the cases' worlds (when any was built), the
lockstep oracle, the storage rules, invariant checks by id *with each title*
(``INV-02 single-write-ack=40``; every id once), and each new failure with
the line that replays it (``replay_lines.get_replay_line``: runnable as printed). The verdict
is the last line (``render_verdict``): passed, FAILED, or INTERRUPTED when a signal cut the run
short (the counts above are then what ran).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hicache_ref.harness.rules import RULES
from hicache_ref.invariant_titles import get_invariant_label

if TYPE_CHECKING:
    from hicache_ref.campaign.pp_share import PpShare
    from hicache_ref.campaign.report import CampaignReport

SUMMARY_WIDTH = 100


def render_summary(
    report: CampaignReport, *, replay_lines: bool = True, verdict: bool = True
) -> str:
    """The summary; ``replay_lines=False`` leaves the replay lines to the caller, and
    ``verdict=False`` the verdict (the gate prints its own, last)."""
    lines = [f"hicache-fuzz: {_named(report)} on {report.device_label}, {_where(report)}"]
    lines += [
        f"  {report.cases} cases, {report.steps} steps ({report.skipped_steps} skipped) in "
        f"{report.seconds:.1f}s = {report.steps / max(report.seconds, 1e-9):.0f} steps/s; "
        f"{report.invariant_checks} invariant checks; {len(report.configs)} distinct configs",
        "  rules hit: " + ", ".join(f"{k}={v}" for k, v in sorted(report.rules.items())),
        "  rule families (share of applied steps): "
        + ", ".join(f"{f} {s:.0%}" for f, s in report.family_shares().items()),
        "  configs: " + "; ".join(_render_feature(n, c) for n, c in report.features.items()),
    ]
    if report.cases_max is not None:  # --max-cases: which budget ended it
        lines.append(_render_case_budget(report, report.cases_max))
    lines += _render_worlds(report)
    if report.auto_copy_paths:  # what copy_path="auto" would pick in each case's world here
        picks = " ".join(f"{k}={v}" for k, v in sorted(report.auto_copy_paths.items()))
        lines.append(f"  copy_path auto takes here (cases): {picks}")
    lines += [
        f"  lockstep oracle: {report.lockstep_cases} of {report.cases} cases, "
        f"{report.lockstep_steps} steps compared"
        + ("" if report.lockstep_cases else " (off: profile, HICACHE_LOCKSTEP or device)")
        + (
            f"; storage oracle: {report.storage_lockstep_cases} cases, "
            f"{report.storage_lockstep_steps} storage steps compared"
            if report.storage_lockstep_cases
            else ""
        ),
    ]
    if report.lockstep_off:  # why the rest were not followed to the end, most frequent first
        reasons = report.lockstep_off.most_common()
        shown = "; ".join(f"{reason} ({n})" for reason, n in reasons[:3])
        more = f"; {len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
        lines.append(f"  lockstep off in {report.lockstep_off.total()} cases: {shown}{more}")
    lines += _render_storage(report)
    if report.checks_by_id:
        checks = [f"{get_invariant_label(k)}={v}" for k, v in sorted(report.checks_by_id.items())]
        lines += wrap_items("  checks by invariant: ", checks)
    lines += _render_failures(report, replay_lines)
    if verdict:
        lines.append(render_verdict(report))
    return "\n".join(lines)


def render_verdict(
    report: CampaignReport, prog: str = "hicache-fuzz", pp: PpShare | None = None
) -> str:
    """The last line: INTERRUPTED (a signal cut it short), FAILED, or passed (with the PP
    gate's cases, when ``pp`` ran: ``pp_share.py``)."""
    new = len(report.failures)
    if report.interrupted:
        found = f"{new} new failure(s) found before it" if new else "no new failure so far"
        return (
            f"{prog}: INTERRUPTED after {report.seconds:.1f}s: {report.cases} cases ran, {found}; "
            "no verdict (run again to the end for one)"
        )
    if new:
        return f"{prog}: FAILED: {new} new failure(s), each with its replay line above"
    known = " new" if report.known_hits else ""
    also = f" and {pp.cases} PP gate cases ({pp.seconds:.0f}s)" if pp and not pp.skipped else ""
    return (
        f"{prog}: passed: no{known} failure in {report.cases} cases ({report.seconds:.0f}s){also}"
    )


def _render_case_budget(report: CampaignReport, cases_max: int) -> str:
    """``  case budget: --max-cases 400 per worker, reached by 2 of 2 workers``: whether the
    cases or something else (the time, a failure, a signal) ended each worker."""
    workers = report.parts or [report]
    reached = sum(1 for worker in workers if worker.cases >= cases_max)
    return (
        f"  case budget: --max-cases {cases_max} per worker, reached by {reached} of "
        f"{len(workers)} worker(s)"
    )


def _render_worlds(report: CampaignReport) -> list[str]:
    """The pool-group worlds drawn with their shares of cases, every kind named (a kind never
    drawn reads 0%: that pass did not cover it)."""
    if not report.cases:
        return []
    worlds = [
        f"{kind} {world['share']:.0%} ({world['drives']})"
        for kind, world in report.world_shares().items()
    ]
    return wrap_items("  pool-group worlds (share of cases): ", worlds)


def _named(report: CampaignReport) -> str:
    """The implementation as given, and its own ``name`` when that differs (an outside one)."""
    if report.name and report.name != report.implementation:
        return f"{report.implementation} (name {report.name!r})"
    return report.implementation


def _render_storage(report: CampaignReport) -> list[str]:
    """The storage rules applied and the storage ids checked, when the campaign drew storage."""
    storage = {
        r: n for r, n in sorted(report.rules.items()) if r in RULES and RULES[r].family == "storage"
    }
    if not storage:
        return []
    share = report.family_shares().get("storage", 0.0)
    rules = [f"{k}={v}" for k, v in storage.items()]
    return wrap_items(f"  storage: {share:.0%} of applied steps: ", rules)


def wrap_items(first: str, items: list[str]) -> list[str]:
    """``items`` joined by commas, in lines of at most ``SUMMARY_WIDTH`` (an item is never cut)."""
    lines, line = [], first
    for i, item in enumerate(items):
        piece = item + ("," if i + 1 < len(items) else "")
        if line.strip() and len(line) + len(piece) + 1 > SUMMARY_WIDTH and line != first:
            lines.append(line.rstrip())
            line = "    "
        line += piece + " "
    lines.append(line.rstrip())
    return lines


def _render_failures(report: CampaignReport, replay_lines: bool) -> list[str]:
    if not report.failures:
        return ["  failures: none" + (" new" if report.known_hits else "")]
    lines = [f"  FAILURES: {len(report.failures)}"]
    for failure in report.failures:
        repeats = report.repeats[failure["invariant"]]
        again = f" (and {repeats} more like it)" if repeats else ""
        lines.append(f"    {get_invariant_label(failure['invariant'])}: {failure['error']}{again}")
        if "pct" in failure:
            lines.append(f"    {render_pct(failure['pct'])}")
        if replay_lines:
            lines.append(f"    replay: {failure['replay']}")
    return lines


def render_pct(pct: Mapping[str, Any]) -> str:
    """Which PCT depth found a failure, and the priority changes its case passed."""
    at = ", ".join(str(i) for i in pct.get("changed_at", []))
    where = f" (at picks {at} of {pct.get('picks', 0)})" if at else ""
    return (
        f"found under PCT depth {pct['depth']}: {pct['changes']} of {int(pct['depth']) - 1} "
        f"priority change(s){where}"
    )


def _where(report: CampaignReport) -> str:
    """Profile, seeds, workers and shard, as the header line says them."""
    stride = f" (then every {report.seed_stride}th)" if report.seed_stride > 1 else ""
    fleet = f", {report.workers} workers" if report.workers > 1 else ""
    shard = f", shard {report.shard}" if report.shard != "1/1" else ""
    database = f", database {report.database}" if report.database else ""
    return f"profile {report.profile}, seed {report.seed}{stride}{fleet}{shard}{database}"


def _render_feature(name: str, counts: Counter[str]) -> str:
    ordered = sorted(counts.items(), key=lambda item: _natural_key(item[0]))
    inner = " ".join(f"{value}={count}" for value, count in ordered)
    return f"{name} {inner or '-'}"


def _natural_key(value: str) -> tuple[int, int, str]:
    """Numbers in numeric order (page 1 2 4 16), then names in alphabetical order."""
    return (0, int(value), "") if value.isdigit() else (1, 0, value)
