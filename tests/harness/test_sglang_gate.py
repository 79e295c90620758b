"""The gate on controllers nobody here wrote: 0.5.10 passes, and every planted bug is caught.

Upstream's ``cache_controller.py`` runs unmodified behind stubs on the simulated device
(``adapters/sglang.py``). A bounded gate over it must find nothing new; each bug of
``tests/harness/sglang_bugs.py``, planted in a copy of the file at test time, must be caught by
one of the invariants it declares, and its minimized trace must pass on the unmodified tree
(so the failure is the planted bug's, not a harness artefact).

The wheel is fetched with pip on first use; a failed fetch fails these tests, it never skips.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from hicache_ref.cli import EXIT_FAILED, EXIT_OK, main
from hicache_ref.harness.adapters.sglang_tree import (
    CONTROLLER_RELPATH,
    SRC_ENV,
    fetch_wheel_tree,
    fork_tree,
)
from hicache_ref.harness.campaigns import known_findings
from hicache_ref.harness.campaigns.known_findings import KnownFinding, get_known_findings
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace

from .sglang_bugs import BUGS, BUGS_0523, PlantedBug

UNMODIFIED_BUDGET = "20s"
BUG_CASES = 1000
"""The planted-bug gates' case budget (``--max-cases``; on a tree with ``storage:pp`` 800 of them
go to the state machine): a gate ends at its first new failure, so this is a bound, not a cost.
Seed 0 catches each bug at the same case however busy the host is: the latest at case 235
(``trailing_window_not_shrunk``), then 159 and 116, the rest by case 20 (benchmarks/RESULTS.md,
the case budget). Which programs a seed draws also depends on the literals Hypothesis collects
from the modules the process imported (a whole-suite process draws others: 159 cases for
io_ignores_termination against 116 alone; RESULTS, 2026-12-07), hence the margin."""
BUG_BUDGET = "900s"
"""A wall-clock safety net only, far past the case budget's time: a busy host makes a planted-bug
gate slower, never blind (under a 180 s wall budget two of them went uncaught at load 20-110)."""
SNIPPET_LINES_MAX = 5
MUST_CATCH = [bug for bug in BUGS if not bug.EXPECTED_UNCAUGHT]
BUG_CLASSES_MIN = 6
STREAM_ORDER_BUGS_MIN = 3
SPEC_IDS = {
    line.split()[0]
    for line in (Path(__file__).resolve().parents[2] / "specs" / "invariant_ids.txt")
    .read_text()
    .splitlines()
    if line.startswith("INV-")
}

UPSTREAM_RESET_FINDING = KnownFinding(
    id="F8",
    implementations=("sglang",),
    invariant="INV-18",
    message_pattern=r"reset\(\) left producer_index",
    summary="0.5.10 reset() never calls layer_done_counter.reset() (upstream_findings F8)",
)
"""Stand-in for the F8 entry of ``known_findings`` while none covering sglang is registered."""

RESET_MESSAGE = "rank 0: reset() left producer_index=0, consumer_indices=[] (expected -1 and [])"


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel_tree() -> Path:
    """The unpacked 0.5.10 wheel (pip on first use; a fetch failure is a test failure)."""
    return fetch_wheel_tree()


@pytest.fixture
def gate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Restore what the gate exports, and count 0.5.10's known reset finding as a baseline."""
    monkeypatch.delenv(SRC_ENV, raising=False)  # --sglang-src sets it; restored at teardown
    registered = get_known_findings([known_findings.ALL], "sglang")
    if known_findings.match_known_finding(registered, "sglang", "INV-18", RESET_MESSAGE) is None:
        table = {**known_findings.KNOWN_FINDINGS, UPSTREAM_RESET_FINDING.id: UPSTREAM_RESET_FINDING}
        monkeypatch.setattr(known_findings, "KNOWN_FINDINGS", MappingProxyType(table))


def run_gate(
    tree: Path,
    out_dir: Path,
    budget: str,
    capsys: pytest.CaptureFixture[str],
    cases: int | None = None,
) -> tuple[int, dict[str, Any], str]:
    """``hicache-fuzz gate --impl sglang --sglang-src TREE`` (``--max-cases CASES`` if given):
    (exit status, report, stdout)."""
    report_path = out_dir / "gate.json"
    case_budget = [] if cases is None else ["--max-cases", str(cases)]
    status = main(
        [
            "gate",
            "--impl", "sglang",
            "--sglang-src", str(tree),
            "--budget", budget,
            "--profile", "ci",
            "--seed", "0",
            # no --known: the gate baselines the findings written up for sglang by default
            "--out", str(out_dir),
            "--json", str(report_path),
            "--no-progress",
            "--workers", "1",  # one process, as before --workers: the budgets assume it
            *case_budget,
        ]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    report: dict[str, Any] = json.loads(report_path.read_text())
    return status, report, stdout


def plant(bug: type[PlantedBug], wheel_tree: Path, tmp_path: Path) -> Path:
    """A tree equal to ``wheel_tree`` but with ``bug`` planted in its ``TARGET`` file."""
    target = Path(bug.TARGET)
    patched = bug.write_patched(wheel_tree / target, tmp_path / target.name)
    return fork_tree(patched, wheel_tree, target)


# -- the catalogue ---------------------------------------------------------------------------
@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.NAME)
def test_planted_bug_is_one_small_substitution(bug: type[PlantedBug], wheel_tree: Path) -> None:
    source = (wheel_tree / CONTROLLER_RELPATH).read_text()
    # Verify the old snippet locates one place and the patch changes it
    assert bug.apply(source) != source
    # Verify no upstream code is carried: a few lines to find one line and change it
    assert bug.OLD.count("\n") <= SNIPPET_LINES_MAX and bug.NEW.count("\n") <= SNIPPET_LINES_MAX
    # Verify the bug names its class and the harness invariants that must catch it
    assert bug.NAME and bug.BUG_CLASS and bug.DESCRIPTION
    assert bug.INVARIANTS and set(bug.INVARIANTS) <= SPEC_IDS


def test_catalogue_covers_the_bug_classes_and_stream_order() -> None:
    assert len({bug.NAME for bug in BUGS}) == len(BUGS)
    assert len({bug.BUG_CLASS for bug in MUST_CATCH}) >= BUG_CLASSES_MIN
    stream_order = [bug for bug in MUST_CATCH if bug.STREAM_ORDER]
    assert len(stream_order) >= STREAM_ORDER_BUGS_MIN
    assert {bug.BUG_CLASS for bug in stream_order} == {"stream order"}


# -- the gate --------------------------------------------------------------------------------
@pytest.mark.usefixtures("gate_env")
def test_unmodified_0_5_10_passes_a_bounded_gate(
    wheel_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gate the unmodified wheel for a bounded budget -> exit 0, nothing new found
    status, report, stdout = run_gate(wheel_tree, tmp_path, UNMODIFIED_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    assert report["gate"]["passed"] and not report["failures"], stdout
    assert report["cases"] > 0 and "hicache-fuzz replay" not in stdout


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", MUST_CATCH, ids=lambda bug: bug.NAME)
def test_planted_bug_is_caught_by_its_invariant(
    bug: type[PlantedBug],
    wheel_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # plant the bug in a copy of 0.5.10 -> gate it -> exit 1 with one replay line
    check_planted_bug_is_caught(bug, wheel_tree, tmp_path, monkeypatch, capsys)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523, ids=lambda bug: bug.NAME)
def test_planted_fence_bug_in_0_5_23_is_caught_with_the_forward_on_its_own_stream(
    bug: type[PlantedBug],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 0.5.23 fences its copies on the forward's own stream; drop one fence -> the gate catches it
    tree = fetch_wheel_tree("0.5.23")
    source = (tree / CONTROLLER_RELPATH).read_text()
    assert bug.apply(source) != source  # the old snippet is there exactly once
    check_planted_bug_is_caught(bug, tree, tmp_path, monkeypatch, capsys)


def check_planted_bug_is_caught(
    bug: type[PlantedBug],
    wheel_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Gate ``bug`` planted in ``wheel_tree``: caught by an invariant it declares, and its
    minimized trace passes on the unmodified tree."""
    tree = plant(bug, wheel_tree, tmp_path)
    status, report, stdout = run_gate(tree, tmp_path, BUG_BUDGET, capsys, cases=BUG_CASES)
    assert status == EXIT_FAILED, f"{bug.NAME} survived {report['cases']} cases:\n{stdout}"
    failure = report["failures"][0]
    assert f"hicache-fuzz replay {failure['trace']}" in stdout
    trace = Trace.read(Path(failure["trace"]))
    # the minimized trace fails on the planted tree, by a harness check the bug declares
    monkeypatch.setenv(SRC_ENV, str(tree))
    on_bug = replay(trace)
    assert on_bug.signature() in bug.INVARIANTS, (on_bug.error, trace.to_jsonl())
    # ... and passes on the unmodified tree: the failure is the planted bug's
    monkeypatch.setenv(SRC_ENV, str(wheel_tree))
    on_upstream = replay(trace)
    assert not on_upstream.failed, (on_upstream.error, trace.to_jsonl())
