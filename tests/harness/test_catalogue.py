"""The catalogue runner: mutants in parallel, one row each, and the guards-off run.

With the ``guards`` capability off (an implementation that refuses nothing, as upstream SGLang)
the machine's misuse probes are disabled; every mutant that is not only about refusing misuse
(``NEEDS_GUARDS = False``) must still be caught, by the invariant it declares.
"""

from __future__ import annotations

import json
from pathlib import Path

from hicache_ref import cli
from hicache_ref.campaign import catalogue
from hicache_ref.campaign.catalogue import CatalogueReport, MutantRow, run_catalogue
from hicache_ref.harness.adapters.mutant import GUARDS, unguarded_name
from hicache_ref.harness.adapters.registry import get_implementation, list_mutants

GUARDS_OFF_CASES_PER_MUTANT = 600
"""Guards off, seed 0 catches every non-guard mutant within 247 cases (the slowest,
``cancel_without_write_sync``; the next 58), 34 s for the whole catalogue on the idle 2-core host
(benchmarks/RESULTS.md): a case budget, so a loaded host makes the test slower, never blind."""
GUARDS_OFF_WALL_CAP_S = 900  # a safety net only, far past the case budget's time under load
PARALLEL_JOBS = 2


def _row(name: str, *, killed: bool, fired: str | None, seconds: float | None) -> MutantRow:
    return MutantRow(
        name=name,
        killed=killed,
        seconds_to_first_failure=seconds,
        shrunk_length=3 if killed else None,
        fired=fired,
        declared=("INV-02",),
        needs_guards=False,
        cases=7,
        campaign_seconds=seconds or 5.0,
        trace="",
        error="",
    )


def test_catalogue_without_guards_still_catches_every_non_guard_mutant(tmp_path: Path) -> None:
    # every NEEDS_GUARDS = False mutant, guards off, ci profile, two processes
    report = run_catalogue(
        None,
        seconds=GUARDS_OFF_WALL_CAP_S,
        cases_max=GUARDS_OFF_CASES_PER_MUTANT,
        profile="ci",
        seed=0,
        out_dir=tmp_path,
        guards=False,
        jobs=PARALLEL_JOBS,
        shrink=False,
    )
    guarded = [name for name in list_mutants() if catalogue.is_guard_mutant(name)]
    assert [row.name for row in report.rows] == [n for n in list_mutants() if n not in guarded]
    assert list(report.skipped) == guarded
    assert not report.missed, report.render()
    assert not report.unpinned, report.render()


def test_unguarded_mutant_lacks_only_the_guards_capability() -> None:
    name = list_mutants()[0]
    guarded = get_implementation(f"mutant:{name}")
    unguarded = get_implementation(unguarded_name(name))
    assert unguarded.capabilities == guarded.capabilities - {GUARDS}
    assert unguarded.name == f"unguarded:{name}"


def test_report_pins_each_row_and_takes_the_median_of_the_kills() -> None:
    rows = (
        _row("a", killed=True, fired="INV-02", seconds=1.0),
        _row("b", killed=True, fired="INV-09", seconds=3.0),
        _row("c", killed=False, fired=None, seconds=None),
    )
    report = CatalogueReport(rows, profile="ci", seed=0, guards=True, seconds=30.0)
    # a pinned, b caught by an undeclared check, c missed -> not clean
    assert [row.pinned for row in rows] == [True, False, False]
    assert report.missed == ["c"] and report.unpinned == ["b"] and not report.is_clean()
    assert report.median_seconds_to_kill == 2.0
    data = report.as_json()
    assert data["killed"] == 2 and data["rows"][0]["pinned"] is True
    json.dumps(data)  # serializable as is
    text = report.render()
    assert "UNPINNED" in text and "MISSED" in text and "median time to kill 2.00s" in text


def test_cli_mutants_prints_the_table_writes_json_and_exits_clean(tmp_path: Path) -> None:
    out_json = tmp_path / "catalogue.json"
    argv = ["mutants", "extra_write_ack", "--budget", "30", "--jobs", "1", "--out", str(tmp_path)]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["rows"][0]["name"] == "extra_write_ack" and data["rows"][0]["pinned"]
    assert data["rows"][0]["shrunk_length"] is not None
