"""A CI user's checklist, end to end, with the console script as a CI job would run it.

1. A wrong target (a tree without ``--impl sglang``) and a malformed tree each exit 2 in one line.
2. A gate signalled at a random moment stops within seconds, on INTERRUPTED, --json written.
3. A failure's replay line runs as printed, from another folder with a clean PATH.
4. ``setup --from`` a wheel, with no package index, serves the gate.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH, fetch_wheel_tree
from tests.test_interrupts import check_interrupted, interrupt_gate
from tests.test_replay_lines import replay_lines, run_as_pasted
from tests.test_setup_from import make_wheel

HICACHE_FUZZ = str(Path(sys.executable).parent / "hicache-fuzz")


def hicache_fuzz(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HICACHE_FUZZ, *argv], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, **env},
    )  # fmt: skip


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout[-800:], done.stderr[-800:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_ci_users_checklist(tmp_path: Path) -> None:
    machine_tree = fetch_wheel_tree()  # 0.5.10, from the machine's cache
    job = tmp_path / "job"
    job.mkdir()

    # 1. the wrong target, then a malformed tree: exit 2, one line each
    wrong = one_line(hicache_fuzz("gate", "--sglang-src", str(machine_tree), cwd=job))
    assert "add --impl sglang" in wrong
    broken = tmp_path / "broken"
    shutil.copytree(machine_tree / "sglang", broken / "sglang")
    (broken / CONTROLLER_RELPATH).write_text("")
    argv = ("gate", "--impl", "sglang", "--sglang-src", str(broken), "--workers", "1")
    malformed = one_line(hicache_fuzz(*argv, "--budget", "5", cwd=job))
    assert (
        str(broken / CONTROLLER_RELPATH) in malformed
        and "defines no HiCacheController" in malformed
    )

    # 2. the job is cancelled mid-gate (SIGTERM to its group) or a person presses Ctrl-C
    signum = random.choice([signal.SIGINT, signal.SIGTERM])
    delay_s = round(random.uniform(0.0, 3.0), 2)
    status, stopped_s, out, err, data = interrupt_gate(job, signum, 2, delay_s)
    check_interrupted(signum, status, stopped_s, out, err, data)

    # 3. a gate that finds a failure: its replay line runs as pasted elsewhere
    found = hicache_fuzz(
        "gate", "--impl", "mutant:extra_write_ack", "--budget", "20", "--workers", "1",
        "--seed", "1000", "--no-progress", "--out", str(job / "out"), cwd=job,
    )  # fmt: skip
    assert found.returncode == 1, found.stdout[-1500:]
    assert found.stdout.splitlines()[-1].startswith("gate: FAILED: 1 new failure(s)")
    lines = replay_lines(found.stdout)
    assert lines
    replayed = run_as_pasted(lines[0], tmp_path / "elsewhere")
    assert replayed.returncode == 1 and "INV-02" in replayed.stdout, replayed.stdout[-1500:]

    # 4. an air-gapped runner: setup --from the wheel, no index, and the gate runs
    wheel = make_wheel(machine_tree, tmp_path)
    offline = {"HICACHE_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"}
    setup = hicache_fuzz("setup", "--from", str(wheel), cwd=job, **offline)
    assert setup.returncode == 0, setup.stderr
    argv = ("gate", "--impl", "sglang", "--budget", "3", "--workers", "1", "--no-progress")
    gated = hicache_fuzz(*argv, "--out", str(job / "out"), cwd=job, **offline)
    assert gated.returncode == 0, gated.stdout[-1500:] + gated.stderr[-800:]
    assert gated.stdout.splitlines()[-1].startswith("gate: passed")
