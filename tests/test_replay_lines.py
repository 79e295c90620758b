"""Every replay line hicache-fuzz prints runs as printed: pasted into a fresh shell, in another
folder, with a clean PATH and none of the variables the run had.

Each line is taken from what ``run``, ``gate`` and ``vectors replay`` printed (the pytest
plugin's are in ``tests/vectors/test_outside_package.py``) and executed by ``sh -c`` from an
empty folder with ``PATH=/usr/bin:/bin`` and no ``PYTHONPATH``: it must reproduce the failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_ref.cli import main
from hicache_ref.harness.adapters import registry
from tests.vectors.outside import write_outside_package

MUTANT = "mutant:extra_write_ack"
STORY = "story-inv02-one-ack-per-write"


def run_as_pasted(line: str, where: Path) -> subprocess.CompletedProcess[str]:
    """``line`` in a fresh shell: another folder, a clean PATH, no PYTHONPATH."""
    where.mkdir(parents=True, exist_ok=True)
    clean = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    for key in ("HICACHE_CACHE_DIR", "HICACHE_SHARED_DIR"):  # where this machine keeps trees
        if key in os.environ:
            clean[key] = os.environ[key]
    return subprocess.run(
        ["sh", "-c", line], cwd=where, env=clean, capture_output=True, text=True, timeout=300
    )


def replay_lines(text: str) -> list[str]:
    """The printed replay lines: ``replay: <line>`` or a bare ``.../hicache-fuzz replay ...``."""
    found = []
    for raw in text.splitlines():
        line = raw.strip().removeprefix("replay: ")
        if (
            re.search(r"hicache-fuzz (replay|vectors replay) ", line)
            or " -m hicache_ref.cli " in line
        ):
            found.append(line)
    return found


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The outside package in a folder of this test's own, imported afresh from there."""
    folder = write_outside_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(folder))
    for name in [m for m in sys.modules if m.split(".")[0] == "outside_impl"]:
        monkeypatch.delitem(sys.modules, name)
    registry.checked_implementation.cache_clear()  # a name checked before, imported afresh
    yield folder
    registry.checked_implementation.cache_clear()


def test_runs_replay_line_runs_as_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--impl", MUTANT, "--budget", "20", "--workers", "1", "--no-progress"]
    assert main([*argv, "--seed", "1000", "--out", str(tmp_path / "out")]) == 1
    lines = replay_lines(capsys.readouterr().out)
    assert lines, "run printed no replay line"
    done = run_as_pasted(lines[0], tmp_path / "elsewhere")
    assert done.returncode == 1, done.stdout[-1500:] + done.stderr[-1500:]
    assert "FAILED after" in done.stdout and "INV-02" in done.stdout


def test_an_outside_packages_gate_line_carries_its_pythonpath(
    outside: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the gate imported outside_impl from a folder the interpreter does not search by itself
    argv = ["gate", "--impl", "outside_impl:mutant", "--budget", "10", "--workers", "1"]
    assert main([*argv, "--no-progress", "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "outside_impl:mutant (name 'outside-mutant')" in out  # its own name, shown
    lines = replay_lines(out)
    assert lines and lines[0].startswith(f"PYTHONPATH={outside} ")
    done = run_as_pasted(lines[0], tmp_path / "elsewhere")
    assert done.returncode == 1, done.stdout[-1500:] + done.stderr[-1500:]
    assert "INV-02" in done.stdout


def test_vectors_replay_prints_a_line_that_replays_the_failing_vector(
    outside: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["vectors", "replay", "--impl", "outside_impl:mutant", "--only", STORY]) == 1
    lines = replay_lines(capsys.readouterr().out)
    assert len(lines) == 1 and lines[0].endswith(f"--only {STORY}")  # --only last: it swallows
    done = run_as_pasted(lines[0], tmp_path / "elsewhere")
    assert done.returncode == 1, done.stdout[-1500:] + done.stderr[-1500:]
    assert f"FAIL {STORY}: INV-02" in done.stdout and "1 vectors, 0 passed, 1 failed" in done.stdout
