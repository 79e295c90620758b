"""What a CI user meets first: the gate reads the target they named or says why not, a broken
tree is one line, the summary ends on its verdict, and the CLI answers the small questions
(``--version``, ``list``, a mistyped flag).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hicache_ref import cli
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.summary import render_summary
from hicache_ref.fleet.progress import ProgressView, Snapshot
from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH, fetch_wheel_tree
from hicache_ref.harness.campaigns.known_findings import get_known_findings
from hicache_ref.invariant_titles import INVARIANT_TITLES


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# -- the right target ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags", [["--sglang-src", "."], ["--sglang-version", "0.5.23"]], ids=["src", "version"]
)
@pytest.mark.parametrize("command", ["gate", "run"])
def test_a_tree_without_impl_sglang_is_refused_not_gated_as_the_reference(
    command: str, flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gate --sglang-src DIR (no --impl) -> exit 2 naming --impl sglang, before any case runs
    assert cli.main([command, *flags, "--budget", "2", "--out", str(tmp_path)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"hicache-fuzz: error: {flags[0]} names an sglang tree")
    assert "add --impl sglang" in line
    assert not list(tmp_path.glob("failure-*"))


def test_the_help_says_the_tree_flags_need_impl_sglang() -> None:
    text = " ".join(cli._subparsers(cli.build_parser())["gate"].format_help().split())
    assert "--impl sglang / seed (required with this flag" in text
    assert "for --impl sglang (required with this flag)" in text


# -- a malformed tree ------------------------------------------------------------------------
def test_an_empty_controller_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an otherwise whole 0.5.10 tree whose cache_controller.py is empty -> exit 2, no traceback
    tree = tmp_path / "tree"
    shutil.copytree(fetch_wheel_tree() / "sglang", tree / "sglang")
    (tree / CONTROLLER_RELPATH).write_text("")
    argv = ["gate", "--impl", "sglang", "--sglang-src", str(tree), "--budget", "2"]
    assert cli.main([*argv, "--workers", "1", "--out", str(tmp_path / "out")]) == 2
    line = _one_line_error(capsys)
    assert str(tree / CONTROLLER_RELPATH) in line
    assert "defines no HiCacheController and no LayerDoneCounter" in line


def test_a_gutted_module_the_controller_imports_is_named_as_the_trees_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(fetch_wheel_tree() / "sglang", tree / "sglang")
    storage = tree / "sglang" / "srt" / "mem_cache" / "hicache_storage.py"
    storage.write_text("")
    argv = ["gate", "--impl", "sglang", "--sglang-src", str(tree), "--budget", "2"]
    assert cli.main([*argv, "--workers", "1", "--out", str(tmp_path / "out")]) == 2
    line = _one_line_error(capsys)
    assert f"imports from {storage}, which lacks it" in line and "the tree is not whole" in line


# -- the summary -----------------------------------------------------------------------------
def _report() -> CampaignReport:
    report = CampaignReport("sglang", "ci", 0, seconds=12.0, cases=40, steps=900)
    report.rules.update({"write": 5, "write_storage": 3, "storage_step": 4})
    report.checks_by_id.update({"INV-02": 7, "INV-19": 4, "INV-30": 4})
    report.known_hits.update({"F8": 3})
    return report


def test_the_summary_ends_on_its_verdict_and_prints_each_id_once() -> None:
    text = render_summary(_report())
    assert text.splitlines()[-1] == "hicache-fuzz: passed: no new failure in 40 cases (12s)"
    for inv_id in ("INV-02", "INV-19", "INV-30"):
        assert text.count(f"{inv_id} ") == 1, inv_id
    assert "copy_path auto takes here" not in text  # no world was built: nothing to say


def test_an_interrupted_summary_ends_on_interrupted() -> None:
    report = _report()
    report.interrupted = True
    assert (
        render_summary(report)
        .splitlines()[-1]
        .startswith("hicache-fuzz: INTERRUPTED after 12.0s: 40 cases ran, no new failure so far")
    )


def test_the_gates_known_findings_are_one_folded_line() -> None:
    known = get_known_findings(["all"], "sglang")
    text = cli.render_gate(_report(), known)
    lines = text.splitlines()
    assert lines[0].startswith("gate: known findings: F8 (INV-18) hit x3, not hit: ")
    assert all(line.startswith("    ") for line in lines[1:])  # folded, never a new entry
    assert all(len(line) <= 100 for line in lines)
    assert sum(text.count(f"{f.id} ") + text.count(f"{f.id},") for f in known) >= len(known)


class _Terminal:
    """A stream that says it is a terminal, and keeps what was written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_the_header_and_the_bar_never_share_a_line() -> None:
    stream = _Terminal()
    view = ProgressView(60, stream=stream)  # type: ignore[arg-type]
    view.say("hicache-fuzz: fuzzing reference for 60s")  # before the bar: a line of its own
    view.update(0, Snapshot(elapsed_s=3, cases=4, steps=90, failures=0, known=0))
    view.say("hicache-fuzz: all 2 workers running")  # while the bar shows: it clears first
    view.close()
    assert stream.text.startswith("hicache-fuzz: fuzzing reference for 60s\n")
    shown = stream.text.replace("\r", "\n")
    said = [line for line in shown.splitlines() if "all 2 workers" in line]
    assert said == ["hicache-fuzz: all 2 workers running"]
    assert "3/60s, cases=4" in shown  # no stray space before the counts


# -- small questions -------------------------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("hicache-fuzz 0.1.0 ")


def test_list_names_every_invariant_known_finding_mutant_and_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["list", "invariants"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{i}  {t}" for i, t in sorted(INVARIANT_TITLES.items())]
    assert cli.main(["list", "known"]) == 0
    known = capsys.readouterr().out
    assert "F8   INV-18  seed,sglang (every release): reset() never resets" in known
    assert "F21  INV-09  sglang (0.5.11..0.5.21): " in known
    assert cli.main(["list", "mutants"]) == 0
    assert any(
        line.split()[:2] == ["extra_write_ack", "INV-02"]
        for line in capsys.readouterr().out.splitlines()
    )
    assert cli.main(["list", "rules"]) == 0
    rules = capsys.readouterr().out.splitlines()
    assert "write path  write" in rules and "storage     storage_step" in rules


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["gat", "--impl", "sglang"], "unknown command 'gat' (did you mean 'gate'?)"),
        (["gate", "--budgte", "5"], "--budgte 5 (did you mean '--budget'?)"),
        (["run", "--sglang-srcc", "x"], "(did you mean '--sglang-src'?)"),
    ],
)
def test_a_mistyped_word_gets_the_nearest_one(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert hint in _one_line_error(capsys)
