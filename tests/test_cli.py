"""hicache-fuzz: bad input is one line and exit 2; the gate passes, fails, and baselines findings.

Every bad argument or file gets one line on stderr that names the problem and the fix, exit
status 2 and no traceback; a bug in the harness itself still raises. The gate exits 0 when
nothing new fails, 1 with one replay line per new failure, and a registered known finding turns
a mutant's exit 1 into 0.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, cast

import pytest

from hicache_ref import cli
from hicache_ref.campaign import rounds as campaign_rounds
from hicache_ref.campaign.cli_inputs import (
    LEGAL_RULES,
    SGLANG_CONTROLLER,
    STEP_ARGUMENTS,
    parse_duration,
)
from hicache_ref.campaign.failures import get_trace_stem
from hicache_ref.campaign.report import RULE_FAMILIES, CampaignReport, get_rule_family
from hicache_ref.campaign.summary import render_summary
from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.fleet.progress import ProgressView, Snapshot
from hicache_ref.fleet.workers import WorkerTask
from hicache_ref.harness.adapters import registry
from hicache_ref.harness.adapters.base import BuildRequest, Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.campaigns import known_findings
from hicache_ref.harness.campaigns.known_findings import (
    KNOWN_FINDINGS,
    KnownFinding,
    get_known_findings,
    match_known_finding,
)
from hicache_ref.harness.campaigns.pp_program_file import PP_PROGRAM_VERSION
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import TRACE_VERSION, Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.replay_lines import get_cli_command

ROOT = Path(__file__).resolve().parents[1]
CORPUS_TRACE = ROOT / "fuzz" / "corpus" / "load_slot_reuse_false_inv08.jsonl"
MUTANT = "mutant:extra_write_ack"
NameImplementation = Callable[[str, Callable[[], object]], None]  # conftest's fixture
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


def _pp_program(op: str) -> str:
    """A PP gate program file (``pp_program_file``) whose one op is ``op``."""
    header = {"version": PP_PROGRAM_VERSION, "implementation": "sglang", "seed": 0}
    program = f'{{"faults": false, "backend": "memory", "points": false, "ops": [{op}]}}'
    return json.dumps(header) + "\n" + program + "\n"


ADVANCE_H2D = '{"rule": "advance", "args": {"stream": "h2d", "n": 1}}\n'


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
    "pp_program_with_an_unknown_verb": (
        lambda d: ["replay", _write(d / "p.jsonl", _pp_program('{"verb": "fly", "pick": 1}'))],
        "line 2 is not a valid program (ops.0.verb: Value error, 'fly' is not a PP program verb)",
    ),
    "pp_program_without_its_program_line": (
        lambda d: ["replay", _write(d / "p.jsonl", _pp_program("").splitlines()[0] + "\n")],
        "has 1 line(s), not 2",
    ),
    "pp_program_on_an_implementation_without_pp": (
        lambda d: [
            "replay",
            _write(d / "p.jsonl", _pp_program('{"verb": "submit", "pick": 1}')),
            "--impl",
            "reference",
        ],
        "lacks storage:pp",
    ),
    "pp_program_given_to_minimize": (
        lambda d: [
            "minimize",
            _write(d / "p.jsonl", _pp_program('{"verb": "submit", "pick": 1}')),
            "-o",
            str(d / "small.jsonl"),
        ],
        "is a PP gate program, not a trace: hicache-fuzz replay runs it",
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
    "zero_cases": (lambda d: ["gate", "--max-cases", "0"], "'0' is not positive; give 1 or more"),
    "negative_cases": (lambda d: ["run", "--max-cases", "-3"], "'-3' is not positive"),
    "cases_not_a_number": (lambda d: ["gate", "--max-cases", "many"], "not a number of cases"),
    "cases_in_a_matrix": (
        lambda d: ["gate", "--impl", "sglang", "--matrix", "0.5.10", "--max-cases", "5"],
        "--max-cases bounds one gate; --matrix gives each release --budget-each",
    ),
    "cases_across_processes": (
        lambda d: ["run", "--cp-processes", "2", "--max-cases", "5", "--seconds", "1"],
        "--workers, --database and --max-cases are for single-process worlds",
    ),
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
    "trace_step_argument_of_the_wrong_type": (
        lambda d: [
            "replay",
            _write(
                d / "t.jsonl", _header_line() + '\n{"rule": "write", "args": {"node": "zero"}}\n'
            ),
        ],
        "line 2 (step 0, write): argument node='zero' is not an integer",
    ),
    "trace_step_with_an_unknown_stream": (
        lambda d: [
            "minimize",
            _write(d / "t.jsonl", _header_line() + "\n" + ADVANCE_H2D),
            "-o",
            str(d / "small.jsonl"),
        ],
        "argument stream='h2d' is not a stream; legal: forward, write, load",
    ),
    "minimize_a_trace_that_passes": (
        lambda d: ["minimize", str(CORPUS_TRACE), "-o", str(d / "small.jsonl")],
        "does not fail on reference: it passes every step and the quiescence checks",
    ),
    "json_under_proc": (
        lambda d: ["gate", "--out", str(d), "--json", "/proc/r.json"],
        "--json /proc/r.json is not writable",
    ),
    "out_under_proc": (lambda d: ["run", "--out", "/proc/hicache-out"], "cannot write files there"),
    "minimize_output_under_proc": (
        lambda d: ["minimize", str(CORPUS_TRACE), "-o", "/proc/small.jsonl"],
        "-o/--output /proc/small.jsonl is not writable",
    ),
    "report_output_under_proc": (
        lambda d: ["report", str(d / "run.json"), "-o", "/proc/report.html"],
        "-o/--output /proc/report.html is not writable",
    ),
    "report_of_a_missing_file": (
        lambda d: ["report", str(d / "run.json"), "-o", str(d / "r.html")],
        "run.json does not exist",
    ),
    "report_of_a_file_that_is_no_campaign_report": (
        lambda d: ["report", _write(d / "run.json", "[1]"), "-o", str(d / "r.html")],
        "is not a campaign report",
    ),
    "zero_workers": (lambda d: ["run", "--workers", "0"], "'0' is not positive"),
    "shard_past_the_count": (lambda d: ["gate", "--shard", "5/4"], "must be 1 to 4"),
    "shard_counted_from_zero": (lambda d: ["run", "--shard", "0/4"], "shards count from 1"),
    "shard_not_a_fraction": (lambda d: ["run", "--shard", "half"], "'half' is not I/N"),
    "database_with_an_unknown_scheme": (
        lambda d: ["run", "--database", "mongodb://x", "--out", str(d)],
        "--database mongodb://x: unknown scheme",
    ),
    "database_nobody_serves": (
        lambda d: ["run", "--database", "redis://127.0.0.1:1", "--out", str(d)],
        "--database redis://127.0.0.1:1: cannot reach redis",
    ),
    "workers_with_cp_processes": (
        lambda d: ["run", "--cp-processes", "2", "--workers", "2", "--out", str(d)],
        "--workers, --database and --max-cases are for single-process worlds",
    ),
    "known_none_with_ids": (
        lambda d: ["gate", "--known", "none", "F8", "--out", str(d)],
        "--known none stands alone",
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
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name_implementation: NameImplementation
) -> None:
    def unbuildable() -> Implementation:
        raise HiCacheSetupError("the sglang tree lacks its allocator; gate a complete tree")

    name_implementation("unbuildable", unbuildable)
    # an adapter that cannot be set up -> the same one line and exit 2
    assert cli.main(["gate", "--impl", "unbuildable", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "hicache-fuzz: error: the sglang tree lacks its allocator; gate a complete tree\n"


class _LazilyUnbuildable(ReferenceImplementation):
    def build_controller(self, request: BuildRequest) -> HiCacheController:
        raise HiCacheSetupError("the sglang tree has no memory_pool_host.py; unpack it whole")


def test_a_setup_error_inside_a_case_is_no_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name_implementation: NameImplementation
) -> None:
    name_implementation("lazy", _LazilyUnbuildable)
    # the controller cannot be built in the first case -> exit 2, not a "new failure"
    argv = ["gate", "--impl", "lazy", "--out", str(tmp_path), "--no-progress", "--workers", "1"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "hicache-fuzz: error: the sglang tree has no memory_pool_host.py; unpack it whole"
    ]
    assert not list(tmp_path.iterdir())


def test_a_bug_in_the_harness_keeps_its_traceback(
    tmp_path: Path, name_implementation: NameImplementation
) -> None:
    def broken() -> Implementation:
        raise RuntimeError("a bug, not an input")

    name_implementation("broken", broken)
    with pytest.raises(RuntimeError, match="a bug, not an input"):
        cli.main(["run", "--impl", "broken", "--out", str(tmp_path)])


def test_sglang_src_is_checked_and_handed_to_the_adapter_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HICACHE_SGLANG_SRC", raising=False)
    (tmp_path / SGLANG_CONTROLLER).parent.mkdir(parents=True)
    (tmp_path / SGLANG_CONTROLLER).write_text("")
    seen: list[str] = []
    real = registry.checked_implementation

    def spy(name: str, source: str = "") -> Any:
        seen.append(source)
        return real(name, source)

    monkeypatch.setattr(cli, "checked_implementation", spy)
    # a valid tree, an unknown implementation -> exit 2; the tree went as an argument
    argv = ["run", "--impl", "sglang", "--sglang-src", str(tmp_path), "--out", str(tmp_path)]

    def tree_read(source: str = "") -> Any:
        raise HiCacheSetupError(f"read {source}")  # where the adapter would load the tree

    monkeypatch.setitem(registry._SOURCED, "sglang", tree_read)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"hicache-fuzz: error: read {tmp_path.resolve()}\n"
    assert seen == [str(tmp_path.resolve())]
    assert "HICACHE_SGLANG_SRC" not in os.environ


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


def test_a_known_finding_scoped_to_releases_matches_only_inside_them() -> None:
    finding = KnownFinding(
        "K", ("sglang",), "INV-24", r"alive", "example", releases="0.5.10..0.5.18"
    )
    assert finding.matches("sglang", "INV-24", "1 thread alive", "0.5.10")
    assert finding.matches("sglang", "INV-24", "1 thread alive", "0.5.15.post1")
    assert finding.matches("sglang", "INV-24", "1 thread alive", "0.5.18")
    assert not finding.matches("sglang", "INV-24", "1 thread alive", "0.5.19")  # fixed there
    assert not finding.matches("sglang", "INV-24", "1 thread alive", "")  # no known release
    unscoped = KnownFinding("U", ("sglang",), "INV-24", r"alive", "every release")
    assert unscoped.matches("sglang", "INV-24", "1 thread alive", "0.5.23")
    assert unscoped.matches("sglang", "INV-24", "1 thread alive")
    with pytest.raises(HiCacheInputError, match=r"is not LO\.\.HI"):
        KnownFinding("B", ("sglang",), "INV-24", r"x", "bad", releases="0.5.10")


def test_known_all_selects_the_entries_for_the_implementation() -> None:
    other = KnownFinding("T-other", ("seed",), "INV-02", "x", "another implementation's")
    table = {**KNOWN_FINDINGS, EXTRA_ACK.id: EXTRA_ACK, other.id: other}
    assert EXTRA_ACK in get_known_findings(["all"], MUTANT, table)
    assert other not in get_known_findings(["all"], MUTANT, table)
    assert get_known_findings([other.id, other.id], MUTANT, table) == (other,)


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
    assert "checks by invariant: INV-02 single-write-ack=4" in render_summary(report)


# -- the gate --------------------------------------------------------------------------------
def _replay_lines(out: str) -> list[str]:
    """The gate's replay lines: this interpreter's hicache-fuzz, ``replay``, the trace."""
    return [line for line in out.splitlines() if line.startswith(f"{get_cli_command()} replay ")]


def _replayed_trace(line: str) -> Path:
    return Path(line.removeprefix(f"{get_cli_command()} replay "))


def test_gate_passes_on_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "gate.json"
    argv = ["gate", "--budget", "3s", "--out", str(tmp_path), "--json", str(report)]
    assert cli.main([*argv, "--no-progress", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "gate: passed" in out and not _replay_lines(out)
    data = json.loads(report.read_text())
    assert data["gate"]["passed"] and data["cases"] > 0
    assert set(data["rule_families"]) == set(RULE_FAMILIES)
    assert set(data["features"]) == {
        *("pool", "layout/io", "cp", "draft", "page", "copy", "hybrid", "forward", "pool group"),
        *("storage", "storage sidecar", "storage pressure", "storage swa", "storage mode"),
    }
    # under the ci profile the pure oracle follows every simulated case, and the report says so
    # lockstep follows every case to the end, or the report names why it stopped: a storage
    # step (the pure oracle's harness rules model no L3) or a side pool (it has none)
    lockstep = data["lockstep"]
    assert lockstep["cases"] + sum(lockstep["off"].values()) == data["cases"]
    assert lockstep["cases"] > 0 and lockstep["steps"] > 0
    for reason in lockstep["off"]:
        rule = reason.removeprefix("the oracle cannot express ").split(":")[0]
        assert get_rule_family(rule) == "storage" or "side pool" in reason, reason
    assert f"lockstep oracle: {data['lockstep']['cases']} of {data['cases']} cases" in out


def test_gate_fails_on_a_mutant_with_one_replay_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gate", "--impl", MUTANT, "--budget", "30s", "--out", str(tmp_path), "--no-progress"]
    assert cli.main([*argv, "--workers", "1"]) == 1
    out = capsys.readouterr().out
    (line,) = _replay_lines(out)
    trace = _replayed_trace(line)
    assert trace.parent == tmp_path and trace.name.endswith("-min.jsonl") and trace.is_file()
    assert "gate: NEW INV-02" in out


def test_a_known_finding_turns_the_mutant_gate_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the package's table is read-only: the test's gate reads a copy with its entry
    table = MappingProxyType({**KNOWN_FINDINGS, EXTRA_ACK.id: EXTRA_ACK})
    monkeypatch.setattr(known_findings, "KNOWN_FINDINGS", table)
    argv = ["gate", "--impl", MUTANT, "--budget", "3s", "--out", str(tmp_path), "--no-progress"]
    argv += ["--workers", "1", "--seed", "1000"]  # seed 1000 hits the mutant in its 2nd case
    # the same mutant, its bug baselined -> counted, not failed
    report_path = tmp_path / "known.json"
    assert cli.main([*argv, "--known", EXTRA_ACK.id, "--json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert f"gate: known findings: {EXTRA_ACK.id} (INV-02) hit x" in out
    assert not _replay_lines(out)
    # a hit ends its case, not its round: the round goes on with the next case (a round that
    # ended at each hit restarted from Hypothesis' simplest case and shrank a known failure)
    report = json.loads(report_path.read_text())
    assert report["known_hits"][EXTRA_ACK.id] > report["rounds"], report["known_hits"]


def test_spins_reach_every_worker_as_the_perturbation_it_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --device cuda --spins 0.25:100..200 --workers 3 -> three workers, each on the GPU with
    # that Perturbation (their trace headers and reports record it, so a replay spins the same
    # way) and each on its own seeds; the GPU check itself is this machine's to fail
    seen: list[WorkerTask] = []

    def fake_fleet(tasks: list[WorkerTask], view: Any, interrupt: Any = None) -> Any:
        seen.extend(tasks)
        raise HiCacheInputError("stop here")

    monkeypatch.setattr(cli, "run_fleet", fake_fleet)
    monkeypatch.setattr("hicache_ref.device.cuda.require_cuda", lambda what="": None)
    argv = ["run", "--device", "cuda", "--spins", "0.25:100..200", "--out", str(tmp_path)]
    assert cli.main([*argv, "--workers", "3"]) == 2
    spins = Perturbation(probability=0.25, cycles_min=100, cycles_max=200, paces=True)
    assert [task.perturbation for task in seen] == [spins] * 3
    assert {task.device for task in seen} == {"cuda"}
    assert [(task.lane.first, task.lane.stride) for task in seen] == [(0, 3), (1, 3), (2, 3)]


# -- a gate CI can trust: replay lines, trace names, outputs, Ctrl-C, progress, names -----------
FAST_MUTANTS = ("mutant:skip_load_fence", "mutant:producer_index_off_by_one")
"""Mutants seed 0 catches in its first cases (under a second each)."""


@pytest.fixture
def twin_gate(
    tmp_path: Path, name_implementation: NameImplementation, capsys: pytest.CaptureFixture[str]
) -> Callable[[str], tuple[set[str], list[str]]]:
    """Gate ``mutant`` under the name "twin" with seed 0 into one folder (as two sglang trees
    gated under "sglang" are): the trace files there after it, and its replay lines."""

    def gate(mutant: str) -> tuple[set[str], list[str]]:
        name_implementation("twin", lambda: registry.get_implementation(mutant))
        argv = ["gate", "--impl", "twin", "--out", str(tmp_path), "--no-progress", "--workers", "1"]
        assert cli.main([*argv, "--budget", "30s"]) == 1
        lines = _replay_lines(capsys.readouterr().out)
        return {path.name for path in tmp_path.glob("failure-twin-seed*.jsonl")}, lines

    return gate


def test_the_printed_replay_line_runs_when_pasted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gate", "--impl", FAST_MUTANTS[0], "--out", str(tmp_path), "--no-progress"]
    assert cli.main([*argv, "--workers", "1", "--budget", "30s"]) == 1
    (line,) = _replay_lines(capsys.readouterr().out)
    # paste the line into a shell with no venv on PATH, from another folder -> it replays
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shell_env = {"PATH": "/usr/bin:/bin", "HOME": str(elsewhere)}
    done = subprocess.run(
        line, shell=True, cwd=elsewhere, env=shell_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert "FAILED after" in done.stdout and "command not found" not in done.stderr


def test_failure_traces_of_two_trees_under_one_name_never_overwrite_each_other(
    twin_gate: Callable[[str], tuple[set[str], list[str]]], tmp_path: Path
) -> None:
    # two implementations gated as "twin", seed 0, into one folder -> two traces (raw + min)
    first, _ = twin_gate(FAST_MUTANTS[0])
    both, _ = twin_gate(FAST_MUTANTS[1])
    assert len(first) == 2 and len(both) == 4 and first < both
    # ... each named by its own text (the same trace always gets the same name), min beside it
    raw = sorted(name for name in both if not name.endswith("-min.jsonl"))
    for name in raw:
        stem = get_trace_stem(Trace.read(tmp_path / name), 0)
        assert name == f"{stem}.jsonl" and f"{stem}-min.jsonl" in both


def test_a_pass_stays_exit_0_when_its_report_cannot_be_written_after_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --json passed its check before the work; the disk then fills -> one line, verdict stands
    real_write = Path.write_text

    def full_disk(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if self.name == "gate.json":
            raise OSError(28, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    argv = ["gate", "--budget", "1s", "--out", str(tmp_path), "--json", str(tmp_path / "gate.json")]
    assert cli.main([*argv, "--no-progress", "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert "gate: passed" in captured.out
    assert captured.err.splitlines() == [
        f"hicache-fuzz: error: --json {tmp_path / 'gate.json'}: No space left on device"
    ]


def test_an_interrupted_campaign_reports_what_it_did_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C during the second round -> the summary of the first, the JSON report, exit 130
    real_run = campaign_rounds.run_state_machine_as_test
    rounds: list[int] = []

    def run_then_interrupt(*args: Any, **kwargs: Any) -> None:
        rounds.append(1)
        if len(rounds) == 2:
            raise KeyboardInterrupt
        real_run(*args, **kwargs)

    monkeypatch.setattr(campaign_rounds, "run_state_machine_as_test", run_then_interrupt)
    report = tmp_path / "run.json"
    argv = ["run", "--budget", "60", "--out", str(tmp_path), "--json", str(report)]
    assert cli.main([*argv, "--no-progress", "--workers", "1"]) == 130
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert "INTERRUPTED after" in out and data["interrupted"] and data["rounds"] == 2
    assert data["cases"] > 0 and f"{data['cases']} cases" in out


def test_ctrl_c_stops_every_worker_and_writes_the_merged_report(tmp_path: Path) -> None:
    # SIGINT to hicache-fuzz (not to its workers) once it runs -> every worker stops and
    # reports, the summary and JSON say so, exit 130 (well before the 600 s budget)
    report = tmp_path / "run.json"
    argv = ["run", "--budget", "600", "--workers", "2", "--out", str(tmp_path)]
    command = [sys.executable, "-m", "hicache_ref.cli", *argv, "--json", str(report)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    first = process.stderr.readline()  # the start line: the CLI runs, its workers start
    assert first.startswith("hicache-fuzz: fuzzing reference for 600s on 2 worker(s)"), first
    running = process.stderr.readline()  # both workers' campaigns are on
    assert running == "hicache-fuzz: all 2 workers running\n", running
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "INTERRUPTED after" in out and "Traceback" not in err
    data = json.loads(report.read_text())
    assert data["interrupted"] and len(data["parts"]) == 2
    assert [part["seed"] for part in data["parts"]] == [0, 1]


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--budget", "1", "--out", str(tmp_path), "--workers", "1"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    # captured stderr is no terminal -> the start line only: no bar, no redraws
    assert err.splitlines() == [
        "hicache-fuzz: fuzzing reference for 1s on 1 worker(s), seeds from 0, shard 1/1; "
        "Ctrl-C stops and reports"
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_line_now_and_then_in_a_log() -> None:
    snapshot = Snapshot(elapsed_s=3.0, cases=5, steps=200, failures=0, known=1)
    terminal, log = _Terminal(), io.StringIO()
    bar = ProgressView(10.0, workers=2, stream=terminal)
    bar.update(0, snapshot)
    bar.update(1, snapshot)
    bar.close()
    assert "fuzzing" in terminal.getvalue() and "steps=400" in terminal.getvalue()
    lines = ProgressView(10.0, workers=2, stream=log, interval_s=0.0)
    lines.update(0, snapshot)
    lines.update(1, snapshot)
    assert log.getvalue().splitlines() == [
        "hicache-fuzz: 3/10s, 1/2 workers, 5 cases, 200 steps, 0 failures, 1 known",
        "hicache-fuzz: 3/10s, 2/2 workers, 10 cases, 400 steps, 0 failures, 2 known",
    ]


@pytest.mark.parametrize("command", ["run", "gate", "mutants"])
def test_one_name_for_the_time_budget(command: str) -> None:
    # --budget everywhere; --seconds (the old spelling) still parses, and --help leaves it out
    assert cli.parse_args([command, "--budget", "2m"]).budget == 120.0
    assert cli.parse_args([command, "--seconds", "90"]).budget == 90.0
    help_text = cli._subparsers(cli.build_parser())[command].format_help()
    assert "--budget" in help_text and "--seconds" not in help_text


def _options_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):  # a subcommand's own options
            for name, sub in action.choices.items():
                missing += _options_without_help(sub, f"{path} {name}")
        elif not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_has_help() -> None:
    assert _options_without_help(cli.build_parser(), "hicache-fuzz") == []


def test_the_gate_baselines_the_findings_written_up_for_the_implementation() -> None:
    upstream = cli.get_gate_known(None, "sglang")
    assert "F8" in {finding.id for finding in upstream}
    assert upstream == get_known_findings(["all"], "sglang")
    assert cli.get_gate_known(["none"], "sglang") == ()
    assert cli.get_gate_known(None, "reference") == ()  # nothing is written up for it


def test_every_step_argument_the_rules_read_has_a_type() -> None:
    # a rule reading an argument the trace checks do not know would let a bad value through
    harness = ROOT / "hicache_ref" / "harness"
    source = "\n".join(p.read_text() for p in harness.rglob("*.py") if "adapters" not in p.parts)
    read = set(re.findall(r'args\.get\("([a-z_]+)"', source))
    read |= set(re.findall(r'args\["([a-z_]+)"\]', source))
    assert read and read <= set(STEP_ARGUMENTS), read - set(STEP_ARGUMENTS)
