"""A gate stopped by Ctrl-C, SIGINT or SIGTERM: within seconds, with what ran, and never a false
finding.

A CI runner that cancels a job, or times it out, sends SIGTERM, often to the whole process
group; a terminal's Ctrl-C sends SIGINT to the group. Either way the gate writes its summary and
its --json, ends on INTERRUPTED, exits 130 (SIGINT) or 143 (SIGTERM), and reports no failure the
interrupt itself caused (a step cut in half proves nothing).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_ref.campaign import rounds as campaign_rounds
from hicache_ref.campaign.interrupts import Interrupt, catching_stop_signals, ignore_stop_signals
from hicache_ref.campaign.rounds import CampaignSignals
from hicache_ref.campaign.run import run_campaign

HICACHE_FUZZ = str(Path(sys.executable).parent / "hicache-fuzz")
STOP_WITHIN_S = 10.0


def test_an_error_after_the_interrupt_is_no_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a signal lands mid-step; what the case does next fails (a half-changed world) -> the
    # campaign ends interrupted, and records nothing
    interrupt = Interrupt()

    def cut_in_half(machine: Any, settings: Any) -> None:
        interrupt.set(signal.SIGTERM)
        raise IndexError("pop from empty list")

    monkeypatch.setattr(campaign_rounds, "run_state_machine_as_test", cut_in_half)
    report = run_campaign(
        "reference", seconds=30, profile="ci", seed=0, out_dir=tmp_path, progress=False,
        signals=CampaignSignals(interrupt, threading.Event()),
    )  # fmt: skip
    assert report.interrupted
    assert report.failures == [] and not report.repeats
    assert not list(tmp_path.glob("failure-*"))


def test_a_worker_that_ignores_stop_signals_for_its_wrap_up_keeps_ignoring_them() -> None:
    # a worker wraps up with stop signals ignored; leaving the catching block must not bring
    # back Python's default SIGINT (a resent one would cut its exit: a traceback on stderr)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with catching_stop_signals(Interrupt()):
            ignore_stop_signals()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        with catching_stop_signals(Interrupt()):  # one that changed nothing puts back what was
            pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_an_error_without_an_interrupt_is_still_a_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(machine: Any, settings: Any) -> None:
        raise IndexError("pop from empty list")

    monkeypatch.setattr(campaign_rounds, "run_state_machine_as_test", fails)
    report = run_campaign(
        "reference", seconds=30, profile="ci", seed=0, out_dir=tmp_path, progress=False,
        signals=CampaignSignals(Interrupt(), threading.Event()),
    )  # fmt: skip
    assert not report.interrupted
    assert [f["invariant"] for f in report.failures] == ["IndexError"]


def interrupt_gate(
    tmp_path: Path, signum: int, workers: int, delay_s: float, impl: str = "sglang"
) -> tuple[int, float, str, str, dict[str, Any]]:
    """Start a gate in a process group of its own, signal the group ``delay_s`` after its
    header line; (exit status, seconds from the signal to the exit, stdout, stderr, --json)."""
    report = tmp_path / "gate.json"
    command = [
        HICACHE_FUZZ, "gate", "--impl", impl, "--budget", "120", "--workers", str(workers),
        "--json", str(report), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    gate = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, cwd=tmp_path,
    )  # fmt: skip
    assert gate.stderr is not None
    header = gate.stderr.readline()
    assert header.startswith("hicache-fuzz: fuzzing"), header
    time.sleep(delay_s)
    os.killpg(gate.pid, signum)
    sent = time.monotonic()
    try:
        out, err = gate.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(gate.pid, signal.SIGKILL)
        raise
    stopped_s = time.monotonic() - sent
    data = json.loads(report.read_text()) if report.is_file() else {}
    return gate.returncode, stopped_s, out, header + err, data


def check_interrupted(
    signum: int, status: int, stopped_s: float, out: str, err: str, data: dict[str, Any]
) -> None:
    """What every interrupted gate must show."""
    assert status == (130 if signum == signal.SIGINT else 143), (status, out[-800:], err)
    assert stopped_s < STOP_WITHIN_S, stopped_s
    assert out.splitlines()[-1].startswith("gate: INTERRUPTED after "), out[-800:]
    assert "gate: NEW" not in out, out  # the interrupt caused no failure
    assert data["interrupted"] and data["gate"]["verdict"] == "interrupted"
    assert data["gate"]["new_failures"] == 0 and not data["gate"]["passed"]
    assert "Traceback" not in err and "leaked semaphore" not in err, err


MOMENTS = random.Random(os.environ.get("HICACHE_INTERRUPT_SEED", str(time.time_ns())))


@pytest.mark.parametrize(
    ("signum", "workers"),
    [(signal.SIGINT, 2), (signal.SIGTERM, 2), (signal.SIGTERM, 1)],
    ids=["sigint-2-workers", "sigterm-2-workers", "sigterm-in-process"],
)
def test_a_gate_interrupted_at_a_random_moment_stops_and_says_so(
    signum: int, workers: int, tmp_path: Path
) -> None:
    # the moment: while the workers start, or while they fuzz (HICACHE_INTERRUPT_SEED replays)
    delay_s = round(MOMENTS.uniform(0.0, 4.0), 2)
    status, stopped_s, out, err, data = interrupt_gate(tmp_path, signum, workers, delay_s)
    print(f"signalled {delay_s}s after the header")
    check_interrupted(signum, status, stopped_s, out, err, data)
