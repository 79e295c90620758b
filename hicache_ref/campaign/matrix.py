"""The release matrix: gate every upstream release in a range and print one table.

``hicache-fuzz gate --impl sglang --matrix 0.5.10..0.5.23 [--budget-each 60s] [--json FILE]``
resolves the range against the registry's list of releases (``adapters/sglang_releases.py``:
cached, with an offline fallback to the trees in the cache), then for each release in version
order: fetch its wheel once, read its shape (``adapters/sglang_shapes.detect_shape``), and run
the gate on it for the budget with the written-up findings baselined (``--known``, default
``all``). One row per release says what happened:

- ``passed``: no failure at all;
- the known findings it hit (``F8 x12``): understood, baselined, the gate passes;
- ``NEW INV-xx`` with its replay line: a failure no written-up finding explains;
- ``refused: <reason>``: the release could not be gated (its one-line setup error).

Each row also says what its gate drove (``drove``: the pool-group worlds, storage and fences by
share of cases, and the PP gate's cases on a release with 0.5.23's PP tickets:
``pp_share.gate_pp_share``, as ``gate`` runs it) and, below the table, what the release has
that no world drove, with the reason (``not driven``; ``release_coverage.py``): a finding that disappears where its code was not
driven is not a fix.

When the set of findings changes between two consecutive releases that ran, the row names what
appeared (``+F21``) and what disappeared (``-F8``), so a fix or a regression shows where it
landed. The matrix passes (exit 0) only when every release passed its gate.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_ref.campaign.pp_share import gate_pp_share, get_pp_share
from hicache_ref.campaign.release_coverage import drove, not_driven
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.campaigns.known_findings import ALL, get_known_findings

MATRIX_IMPL = "sglang"
BUDGET_EACH_DEFAULT_S = 60.0


@dataclass
class ReleaseRow:
    """One release's gate: its shape, what ran, and what was found."""

    release: str
    shape: str = "-"
    cases: int = 0
    steps: int = 0
    seconds: float = 0.0
    known_hits: dict[str, int] = field(default_factory=dict)
    new_failures: list[dict[str, str]] = field(default_factory=list)
    refused: str = ""
    appeared: list[str] = field(default_factory=list)
    disappeared: list[str] = field(default_factory=list)
    drove: list[str] = field(default_factory=list)
    not_driven: list[tuple[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.refused and not self.new_failures

    @property
    def findings(self) -> frozenset[str]:
        """Known ids hit and new failures by invariant (``NEW INV-07``)."""
        new = {f"NEW {failure['invariant']}" for failure in self.new_failures}
        return frozenset(self.known_hits) | new

    def result(self) -> str:
        if self.refused:
            return f"refused: {self.refused}"
        parts = [f"NEW {f['invariant']}" for f in self.new_failures]
        parts += [f"{fid} x{count}" for fid, count in sorted(self.known_hits.items())]
        return ", ".join(parts) if parts else "passed"

    def changes(self) -> str:
        return " ".join([*(f"+{f}" for f in self.appeared), *(f"-{f}" for f in self.disappeared)])

    def as_json(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "shape": self.shape,
            "cases": self.cases,
            "steps": self.steps,
            "seconds": round(self.seconds, 1),
            "passed": self.passed,
            "result": self.result(),
            "known_hits": dict(sorted(self.known_hits.items())),
            "new_failures": self.new_failures,
            "refused": self.refused or None,
            "appeared": self.appeared,
            "disappeared": self.disappeared,
            "drove": self.drove,
            "not_driven": {part: reason for part, reason in self.not_driven},
        }


def mark_transitions(rows: Sequence[ReleaseRow]) -> None:
    """Name, on each row, the findings that appeared or disappeared since the previous release
    that ran (refused releases are skipped: they say nothing about a finding)."""
    previous: ReleaseRow | None = None
    for row in rows:
        if row.refused:
            continue
        if previous is not None:
            row.appeared = sorted(row.findings - previous.findings)
            row.disappeared = sorted(previous.findings - row.findings)
        previous = row


def gate_release(
    release: str,
    *,
    budget_s: float,
    profile: str,
    seed: int,
    out_dir: Path,
    known_ids: Sequence[str],
    keep_going: bool = False,
    progress: bool = False,
    shrink: bool = False,
) -> ReleaseRow:
    """Fetch ``release``, read its shape and gate it; a setup problem becomes ``refused``."""
    from hicache_ref.campaign.run import run_campaign
    from hicache_ref.harness.adapters.registry import checked_implementation
    from hicache_ref.harness.adapters.sglang import SglangImplementation
    from hicache_ref.harness.adapters.sglang_releases import fetch_release_tree

    row = ReleaseRow(release)
    release_out = out_dir / f"sglang-{release}"
    try:
        tree = fetch_release_tree(release, "--matrix")
        implementation = SglangImplementation(tree)
        row.shape = implementation.shape.label
        row.not_driven = not_driven(tree, implementation.capabilities)
        checked_implementation(MATRIX_IMPL, str(tree))  # the contract's preflight
        report = run_campaign(
            MATRIX_IMPL,
            seconds=budget_s * (1 - get_pp_share(implementation.capabilities)),
            profile=profile,
            seed=seed,
            out_dir=release_out,
            stop_on_failure=not keep_going,
            progress=progress,
            shrink=shrink,
            known=get_known_findings(known_ids, MATRIX_IMPL),
            source=str(tree),
        )
    except HiCacheInputError as exc:  # a HiCacheSetupError too: the release cannot be gated
        row.refused = " ".join(str(exc).split())
        return row
    pp = gate_pp_share(
        report,
        implementation,
        impl=MATRIX_IMPL,
        budget_s=budget_s,
        seed=seed,
        out_dir=release_out,
        keep_going=keep_going,
        known=get_known_findings(known_ids, MATRIX_IMPL),
    )
    if pp is not None and pp.interrupted:  # Ctrl-C ends the matrix, as in its campaigns
        raise KeyboardInterrupt
    row.cases, row.steps, row.seconds = report.cases, report.steps, report.seconds
    row.drove = drove(report)
    if pp is not None and not pp.skipped:  # the PP gate's cases are a part the row drove
        row.seconds += pp.seconds
        sides = f"{pp.worlds.get('swa', 0)} swa, {pp.worlds.get('mamba', 0)} mamba"
        row.drove.append(f"pp tickets {pp.cases} cases ({sides})")
    row.known_hits = dict(report.known_hits)
    row.new_failures = [
        {"invariant": f["invariant"], "error": f["error"], "trace": f["trace"]}
        for f in report.failures
    ]
    return row


def render_matrix(rows: Sequence[ReleaseRow]) -> str:
    """The table: release, shape, cases, result, and what changed since the previous release."""
    header = ("release", "shape", "cases", "drove", "result", "changes")
    body = [
        (r.release, r.shape, str(r.cases), ", ".join(r.drove) or "-", r.result(), r.changes())
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for row in rows:
        for part, reason in row.not_driven:
            lines.append(f"{row.release}: not driven: {part}: {reason}")
    for row in rows:
        for failure in row.new_failures:
            if failure["trace"]:
                lines.append(f"{row.release}: hicache-fuzz replay {failure['trace']}")
    passed = sum(row.passed for row in rows)
    verdict = "passed" if passed == len(rows) else "FAILED"
    lines.append(f"matrix: {verdict}: {passed} of {len(rows)} release(s) passed their gate")
    return "\n".join(lines)


def matrix_json(rows: Sequence[ReleaseRow], source: str) -> dict[str, Any]:
    return {
        "passed": all(row.passed for row in rows),
        "versions_from": source,
        "releases": [row.as_json() for row in rows],
    }


def cmd_matrix(args: argparse.Namespace) -> int:
    """``gate --matrix``: every release of the range, one table; exit 1 unless all passed."""
    from hicache_ref.campaign.cli_inputs import check_out_dir, check_output_file
    from hicache_ref.harness.adapters.sglang_releases import registry_versions, resolve_releases

    if args.impl != MATRIX_IMPL:
        raise HiCacheInputError(
            f"--matrix gates upstream releases: use it with --impl {MATRIX_IMPL}, not {args.impl!r}"
        )
    if args.sglang_src or args.sglang_version:
        raise HiCacheInputError(
            "--matrix names the releases itself; drop --sglang-src / --sglang-version"
        )
    if getattr(args, "max_cases", None) is not None:
        raise HiCacheInputError(
            "--max-cases bounds one gate; --matrix gives each release --budget-each: drop "
            "--max-cases"
        )
    out_dir = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    known_ids = args.known or [ALL]
    get_known_findings(known_ids, MATRIX_IMPL)  # an unknown id: one line before any work
    source = "as listed"
    versions: list[str] | None = None
    if ".." in args.matrix:
        versions, source = registry_versions()
    releases = resolve_releases(args.matrix, versions)
    budget_s = args.budget_each if args.budget_each is not None else BUDGET_EACH_DEFAULT_S
    rows: list[ReleaseRow] = []
    for release in releases:
        row = gate_release(
            release,
            budget_s=budget_s,
            profile=args.profile,
            seed=args.seed,
            out_dir=out_dir,
            known_ids=known_ids,
            keep_going=args.keep_going,
            progress=not args.no_progress,
            shrink=args.hypothesis_shrink,
        )
        rows.append(row)
        print(f"matrix: {release} ({row.shape}): {row.cases} cases, {row.result()}", flush=True)
    mark_transitions(rows)
    print(render_matrix(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(matrix_json(rows, source), indent=2) + "\n")
        print(f"  report: {args.json}")
    return 0 if all(row.passed for row in rows) else 1
