"""hicache-fuzz: bad input is one line and exit 2; the gate passes, fails, and baselines findings.

Every bad argument or file gets one line on stderr that names the problem and the fix, exit
status 2 and no traceback; a bug in the harness itself still raises. The gate exits 0 when
nothing new fails, 1 with one replay line per new failure, and a registered known finding turns
a mutant's exit 1 into 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hicache_ref import cli
from hicache_ref.campaign import RULE_FAMILIES, CampaignReport, get_rule_family
from hicache_ref.cli_inputs import LEGAL_RULES, SGLANG_CONTROLLER, parse_duration
from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.harness.adapters import registry
from hicache_ref.harness.adapters.base import BuildRequest, Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.config import HarnessConfig
from hicache_ref.harness.known_findings import (
    KNOWN_FINDINGS,
    KnownFinding,
    get_known_findings,
    match_known_finding,
)
from hicache_ref.harness.session import Session
from hicache_ref.harness.trace import TRACE_VERSION

ROOT = Path(__file__).resolve().parents[1]
CORPUS_TRACE = ROOT / "fuzz" / "corpus" / "load_slot_reuse_false_inv08.jsonl"
MUTANT = "mutant:extra_write_ack"
EXTRA_ACK = KnownFinding(
    id="T-extra-ack",
    implementations=(MUTANT,),
    invariant="INV-02",
    message_pattern=r"two undrained write acks",
    summary="the mutant appends a second ack for one write",
)


def _header_line(**changes: object) -> str:
    header = json.loads(CORPUS_TRACE.read_text().splitlines()[0])
    header.update(changes)
    return json.dumps(header)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- bad input: one line, exit 2 -------------------------------------------------------------
BAD_INPUTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "missing_trace_file": (lambda d: ["replay", str(d / "nope.jsonl")], "does not exist"),
    "trace_is_a_folder": (lambda d: ["replay", str(d)], "is a folder"),
    "empty_trace": (lambda d: ["replay", _write(d / "t.jsonl", "")], "is empty"),
    "trace_not_json": (lambda d: ["replay", _write(d / "t.jsonl", "not json\n")], "not JSON"),
    "trace_line_not_an_object": (
        lambda d: ["replay", _write(d / "t.jsonl", "[1, 2]\n")],
        "not an object",
    ),
    "trace_bad_header": (
        lambda d: ["replay", _write(d / "t.jsonl", _header_line(config={"page_size": "x"}))],
        "not a valid header",
    ),
    "trace_wrong_version": (
        lambda d: ["replay", _write(d / "t.jsonl", _header_line(version="hicache-trace/0"))],
        f"reads {TRACE_VERSION!r}",
    ),
    "trace_step_with_unknown_rule": (
        lambda d: [
            "replay",
            _write(d / "t.jsonl", _header_line() + '\n{"rule": "frobnicate", "args": {}}\n'),
        ],
        "line 2 has unknown rule 'frobnicate'; legal rules: prefill",
    ),
    "trace_step_with_bad_args": (
        lambda d: [
            "replay",
            _write(d / "t.jsonl", _header_line() + '\n{"rule": "noop", "args": {"x": []}}\n'),
        ],
        "line 2 is not a valid step",
    ),
    "replay_unknown_implementation": (
        lambda d: ["replay", str(CORPUS_TRACE), "--impl", "nope"],
        "unknown implementation 'nope'",
    ),
    "run_unknown_implementation": (
        lambda d: ["run", "--impl", "nope", "--out", str(d)],
        "unknown implementation 'nope'; legal: reference",
    ),
    "unknown_mutant": (
        lambda d: ["gate", "--impl", "mutant:nope", "--out", str(d)],
        "no mutant 'nope'",
    ),
    "unknown_profile": (lambda d: ["run", "--profile", "fast"], "invalid choice: 'fast'"),
    "negative_seconds": (lambda d: ["run", "--seconds", "-5"], "'-5' is not positive"),
    "zero_seconds": (lambda d: ["run", "--seconds", "0"], "'0' is not positive"),
    "zero_budget": (lambda d: ["gate", "--budget", "0s"], "'0s' is not positive"),
    "budget_not_a_duration": (lambda d: ["gate", "--budget", "soon"], "not a duration"),
    "negative_mutants_seconds": (lambda d: ["mutants", "--seconds", "-1"], "not positive"),
    "out_is_a_file": (
        lambda d: ["run", "--out", _write(d / "f", ""), "--seconds", "1"],
        "--out",
    ),
    "json_in_missing_folder": (
        lambda d: ["gate", "--out", str(d), "--json", str(d / "no" / "r.json")],
        "does not exist",
    ),
    "json_is_a_folder": (lambda d: ["run", "--out", str(d), "--json", str(d)], "is a folder"),
    "minimize_output_is_a_folder": (
        lambda d: ["minimize", str(CORPUS_TRACE), "-o", str(d)],
        "is a folder",
    ),
    "minimize_without_output": (lambda d: ["minimize", str(CORPUS_TRACE)], "required"),
    "sglang_src_missing": (
        lambda d: ["gate", "--impl", "sglang", "--sglang-src", str(d / "x"), "--out", str(d)],
        "no such folder",
    ),
    "sglang_src_without_controller": (
        lambda d: ["gate", "--impl", "sglang", "--sglang-src", str(d), "--out", str(d)],
        "cache_controller.py, which is missing",
    ),
    "unknown_known_finding": (
        lambda d: ["gate", "--known", "F999", "--out", str(d)],
        "unknown known-finding id 'F999'; known ids:",
    ),
    "spins_not_a_range": (
        lambda d: ["run", "--device", "cuda", "--spins", "half"],
        "'half' is not P:MIN..MAX",
    ),
    "spins_probability_past_one": (
        lambda d: ["run", "--device", "cuda", "--spins", "1.5:10..20"],
        "probability=1.5 must be in [0, 1]",
    ),
    "spins_range_reversed": (
        lambda d: ["gate", "--device", "cuda", "--spins", "0.5:20..10"],
        "must satisfy 1 <= cycles_min <= cycles_max",
    ),
    "spins_on_the_simulator": (
        lambda d: ["run", "--spins", "0.5:10..20", "--out", str(d), "--seconds", "1"],
        "--spins perturbs a GPU's streams; add --device cuda",
    ),
    "spins_across_processes": (
        lambda d: ["run", "--cp-processes", "2", "--spins", "0.5:10..20", "--seconds", "1"],
        "--spins is for a single-process GPU campaign",
    ),
    "unknown_flag": (lambda d: ["gate", "--bogus"], "unrecognized arguments: --bogus"),
    "unknown_command": (lambda d: ["frobnicate"], "unknown command 'frobnicate'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv_for, fragment = BAD_INPUTS[case]
    # bad input -> exit 2, one line on stderr naming the problem, no traceback
    assert cli.main(argv_for(tmp_path)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("hicache-fuzz: error: ") and "Traceback" not in err
    assert fragment in err, err


def test_argparse_errors_point_at_the_subcommand_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--profile", "fast"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("; see hicache-fuzz run --help")


def test_a_setup_error_from_an_adapter_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unbuildable() -> Implementation:
        raise HiCacheSetupError("the sglang tree lacks its allocator; gate a complete tree")

    monkeypatch.setitem(registry._FACTORIES, "unbuildable", unbuildable)
    # an adapter that cannot be set up -> the same one line and exit 2
    assert cli.main(["gate", "--impl", "unbuildable", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "hicache-fuzz: error: the sglang tree lacks its allocator; gate a complete tree\n"


class _LazilyUnbuildable(ReferenceImplementation):
    def build_controller(self, request: BuildRequest) -> HiCacheController:
        raise HiCacheSetupError("the sglang tree has no memory_pool_host.py; unpack it whole")


def test_a_setup_error_inside_a_case_is_no_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry._FACTORIES, "lazy", _LazilyUnbuildable)
    # the controller cannot be built in the first case -> exit 2, not a "new failure"
    assert cli.main(["gate", "--impl", "lazy", "--out", str(tmp_path), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "hicache-fuzz: error: the sglang tree has no memory_pool_host.py; unpack it whole"
    ]
    assert not list(tmp_path.iterdir())


def test_a_bug_in_the_harness_keeps_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> Implementation:
        raise RuntimeError("a bug, not an input")

    monkeypatch.setitem(registry._FACTORIES, "broken", broken)
    with pytest.raises(RuntimeError, match="a bug, not an input"):
        cli.main(["run", "--impl", "broken", "--out", str(tmp_path)])


def test_sglang_src_is_checked_and_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HICACHE_SGLANG_SRC", raising=False)
    (tmp_path / SGLANG_CONTROLLER).parent.mkdir(parents=True)
    (tmp_path / SGLANG_CONTROLLER).write_text("")
    # a valid tree, an unknown implementation -> the tree is exported before the build fails
    assert (
        cli.main(["run", "--impl", "nope", "--sglang-src", str(tmp_path), "--out", str(tmp_path)])
        == 2
    )
    capsys.readouterr()
    assert os.environ["HICACHE_SGLANG_SRC"] == str(tmp_path.resolve())


def test_the_console_script_answers_bad_input_in_one_line() -> None:
    script = Path(sys.executable).parent / "hicache-fuzz"
    done = subprocess.run(
        [str(script), "run", "--seconds", "-5"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "hicache-fuzz: error: argument --seconds: '-5' is not positive; give a time to run "
        "for, such as 60 or 2m; see hicache-fuzz run --help"
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("120", 120.0), ("120s", 120.0), ("2m", 120.0), ("1.5m", 90.0), ("1h", 3600.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


# -- known findings --------------------------------------------------------------------------
def test_a_known_finding_matches_implementation_invariant_and_message() -> None:
    finding = KnownFinding("K", ("sglang", "mutant"), "INV-02", r"two .* acks", "example")
    assert finding.matches("sglang", "INV-02", "rank 0: node(s) [4] have two undrained write acks")
    assert finding.matches("mutant:extra_write_ack", "INV-02", "two write acks")
    assert not finding.matches("sglangx", "INV-02", "two write acks")  # a prefix ends at ':'
    assert not finding.matches("seed", "INV-02", "two write acks")
    assert not finding.matches("sglang", "INV-03", "two write acks")
    assert not finding.matches("sglang", "INV-02", "one write ack")
    assert match_known_finding((finding,), "sglang", "INV-02", "no acks") is None


def test_known_all_selects_the_entries_for_the_implementation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = KnownFinding("T-other", ("seed",), "INV-02", "x", "another implementation's")
    monkeypatch.setitem(KNOWN_FINDINGS, EXTRA_ACK.id, EXTRA_ACK)
    monkeypatch.setitem(KNOWN_FINDINGS, other.id, other)
    assert EXTRA_ACK in get_known_findings(["all"], MUTANT)
    assert other not in get_known_findings(["all"], MUTANT)
    assert get_known_findings([other.id, other.id], MUTANT) == (other,)


# -- the report ------------------------------------------------------------------------------
def test_every_rule_has_a_family() -> None:
    in_families = {rule for rules in RULE_FAMILIES.values() for rule in rules}
    assert in_families == set(LEGAL_RULES)
    assert get_rule_family("probe_something_new") == "misuse"


def test_the_report_counts_checks_by_id_families_and_features() -> None:
    report = CampaignReport("reference", "ci", 0)
    config = HarnessConfig(pool_kind="nsa", cp_size=2, layer_num=2, draft_layer_num=3)
    stats = SimpleNamespace(
        steps=4,
        skipped=0,
        rules=Counter({"write": 1, "load": 1, "drain_acks": 2}),
        invariant_checks=4,
        checks_by_id=Counter({"INV-02": 4}),
    )
    # a stand-in with just what absorb reads from a finished Session: its stats and config
    report.absorb(cast(Session, SimpleNamespace(stats=stats, config=config)))
    data = report.as_json()
    assert data["checks_by_id"] == {"INV-02": 4}
    assert data["rule_families"]["acks"] == {"steps": 2, "share": 0.5}
    assert data["features"]["cp"] == {"2": 1} and data["features"]["draft"] == {"deeper": 1}
    assert "checks by invariant: INV-02=4" in report.render()


# -- the gate --------------------------------------------------------------------------------
def _replay_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("hicache-fuzz replay ")]


def test_gate_passes_on_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "gate.json"
    argv = ["gate", "--budget", "3s", "--out", str(tmp_path), "--json", str(report)]
    assert cli.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "gate: passed" in out and not _replay_lines(out)
    data = json.loads(report.read_text())
    assert data["gate"]["passed"] and data["cases"] > 0
    assert set(data["rule_families"]) == set(RULE_FAMILIES)
    assert set(data["features"]) == {
        *("pool", "layout/io", "cp", "draft", "page", "copy", "hybrid", "forward", "pool group"),
        "storage",
    }
    # under the ci profile the pure oracle follows every simulated case, and the report says so
    # lockstep follows every case but those where a storage step turned it off (it models no L3)
    without_storage = data["features"]["storage"].get("none", 0)
    assert without_storage <= data["lockstep"]["cases"] <= data["cases"]
    assert data["lockstep"]["steps"] > 0
    assert f"lockstep oracle: {data['lockstep']['cases']} of {data['cases']} cases" in out


def test_gate_fails_on_a_mutant_with_one_replay_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gate", "--impl", MUTANT, "--budget", "30s", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    (line,) = _replay_lines(out)
    trace = Path(line.removeprefix("hicache-fuzz replay "))
    assert trace.parent == tmp_path and trace.name.endswith("-min.jsonl") and trace.is_file()
    assert "gate: NEW INV-02" in out


def test_a_known_finding_turns_the_mutant_gate_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(KNOWN_FINDINGS, EXTRA_ACK.id, EXTRA_ACK)
    argv = ["gate", "--impl", MUTANT, "--budget", "3s", "--out", str(tmp_path), "--no-progress"]
    # the same mutant, its bug baselined -> counted, not failed
    assert cli.main([*argv, "--known", EXTRA_ACK.id]) == 0
    out = capsys.readouterr().out
    assert f"gate: known {EXTRA_ACK.id} hit x" in out and not _replay_lines(out)


def test_spins_reach_the_campaign_as_the_perturbation_it_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --device cuda --spins 0.25:100..200 -> run_campaign gets that Perturbation (its trace
    # headers and report record it, so a replay spins the same way)
    seen: dict[str, Any] = {}

    def fake_campaign(impl: str, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise HiCacheInputError("stop here")

    monkeypatch.setattr(cli, "run_campaign", fake_campaign)
    argv = ["run", "--device", "cuda", "--spins", "0.25:100..200", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert seen["perturbation"] == Perturbation(
        probability=0.25, cycles_min=100, cycles_max=200, paces=True
    )
    assert seen["device"] == "cuda"
