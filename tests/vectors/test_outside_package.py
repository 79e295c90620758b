"""An implementation outside this repository, checked three ways: ``--impl pkg.module:factory``,
the ``hicache_ref.implementations`` entry-point group, and the pytest plugin; and a contract
break caught before any case runs (exit 2), not reported as a finding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_ref.cli import main
from hicache_ref.harness.adapters.registry import get_implementation, known_names
from tests.test_replay_lines import replay_lines, run_as_pasted
from tests.vectors.outside import write_outside_package

STORY = "story-inv02-one-ack-per-write"


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = write_outside_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_a_factory_path_and_an_entry_point_name_the_same_outside_implementation(
    outside: Path,
) -> None:
    by_path = get_implementation("outside_impl:mutant")
    by_entry_point = get_implementation("outside-mutant")
    assert by_path.name == by_entry_point.name == "outside-mutant"
    assert "outside-reference" in known_names()


def test_vectors_replay_fails_the_outside_mutant_and_passes_its_reference(
    outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the outside mutant acks every write twice -> the story of one ack per write fails it
    assert main(["vectors", "replay", "--impl", "outside_impl:mutant", "--only", STORY]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {STORY}: INV-02 at step" in out
    assert "1 vectors, 0 passed, 1 failed" in out
    assert main(["vectors", "replay", "--impl", "outside-reference", "--only", STORY]) == 0


def test_gate_and_mutants_take_an_outside_implementation(
    outside: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    # caps, not costs: a gate and a catalogue entry end at the first failure, which comes in the
    # first cases; on a loaded host one case once took the whole of a 5 s cap
    args = ["--budget", "30s", "--no-progress", "--out", out]
    assert main(["gate", "--impl", "outside_impl:mutant", *args]) == 1
    assert "gate: NEW INV-02" in capsys.readouterr().out
    catalogue = ["mutants", "--impl", "outside_impl:mutant", "--seconds", "30", "--jobs", "1"]
    assert main([*catalogue, "--out", out]) == 0  # caught, by the id its module declares
    assert "1/1 mutants caught, 0 by an undeclared check" in capsys.readouterr().out


def test_a_renamed_method_is_a_contract_error_before_any_case(
    outside: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the contract check this ran a campaign and reported a NEW AttributeError (exit 1)
    code = main(
        ["gate", "--impl", "outside_impl:renamed", "--budget", "5s", "--out", str(tmp_path)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "has no method start_loading()" in err
    assert not list(tmp_path.glob("failure-*"))  # no case ran, no trace was written


REFERENCE_GATE_SECONDS = "3"
"""The reference's gate item runs its whole budget (it finds nothing), so it is kept short."""
MUTANT_GATE_SECONDS = "30"
"""A cap, not a cost: the mutant's gate item ends at its first failure (it acks every write
twice, so its first cases fail); 3 s let it pass once, with two test processes on a host whose
load average was past 15 (benchmarks/RESULTS.md, the default test run's time)."""


def _pytest(
    outside: Path, tmp_path: Path, spec: str, gate_seconds: str = REFERENCE_GATE_SECONDS
) -> subprocess.CompletedProcess[str]:
    user_tests = tmp_path / "user_tests"
    user_tests.mkdir(exist_ok=True)
    (user_tests / "test_their_own.py").write_text("def test_their_own_code():\n    assert True\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(outside), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(user_tests),
        "--hicache-impl", spec, "--hicache-vectors", "stories", "--hicache-gate-seconds", gate_seconds,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )


def test_the_pytest_plugin_fails_the_outside_mutant_with_replay_lines(
    outside: Path, tmp_path: Path
) -> None:
    run = _pytest(outside, tmp_path, "outside_impl:mutant", MUTANT_GATE_SECONDS)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "hicache-vectors::story-inv02-one-ack-per-write" in run.stdout
    assert "hicache-gate::outside_impl:mutant" in run.stdout
    # every printed line runs as pasted: another folder, a clean PATH, no PYTHONPATH
    lines = replay_lines(run.stdout)
    vector_lines = [line for line in lines if " vectors replay " in line]
    assert all(re.search(r" --only [\w-]+$", line) for line in vector_lines)  # --only last
    story = [line for line in vector_lines if line.endswith(f"--only {STORY}")]
    gate = [line for line in lines if " vectors replay " not in line]
    assert story and gate
    for line in (story[0], gate[0]):
        done = run_as_pasted(line, tmp_path / "elsewhere")
        assert done.returncode == 1, (line, done.stdout[-1500:], done.stderr[-1500:])
        assert "INV-02" in done.stdout
    assert "1 passed" not in run.stdout.splitlines()[-1] or "failed" in run.stdout.splitlines()[-1]


def test_the_pytest_plugin_passes_the_outside_reference(outside: Path, tmp_path: Path) -> None:
    run = _pytest(outside, tmp_path, "outside-reference")
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]
