"""The GPU benchmark scripts answer bad input in one line, on any machine (before any GPU work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("transfer.py", ["--tiles", "32y8"], "give ROWSxWARPS pairs"),
        ("transfer.py", ["--tiles", "32x8x2"], "give ROWSxWARPS pairs"),
        ("transfer_profile.py", ["--cases", "batch:mla:16"], "is not PATH:ROWS:PAGE"),
        ("transfer_profile.py", ["--cases", "copy:mla:16:layer_first:h2d"], "path batch|triton"),
        ("transfer_profile.py", ["--mode", "kernel"], "needs --cases"),
        ("transfer_profile.py", ["--mode", "pinned", "--tile", "16"], "give ROWSxWARPS pairs"),
        ("transfer_bounds.py", ["--experiments", "ceiling,speed"], "unknown ['speed']"),
        ("transfer_bounds.py", ["--grids", "8,x"], "comma-separated integers"),
        ("transfer_bounds.py", ["--span-layers", "0"], "must be >= 1"),
        ("transfer_bounds.py", ["--bidir-rows", "mla,gqa"], "choose from mla,mha"),
        ("transfer_bounds.py", ["--tiles", "32"], "give ROWSxWARPS pairs"),
        ("transfer_bounds.py", ["--reps", "3"], "at least five runs"),
        ("host_waits.py", ["no/such/trace.jsonl"], "is not a file"),
        ("host_waits.py", ["README.md", "--spin-ms", "0"], "must be > 0"),
    ],
)
def test_a_bad_benchmark_argument_is_refused_in_one_line(
    script: str, args: list[str], message: str
) -> None:
    result = _run(script, *args)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0
    assert "Traceback" not in output
    assert message in output.splitlines()[-1]


def test_a_copy_kernel_is_placed_by_its_phase_in_the_matmul_running_when_it_started() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import transfer_bounds as bounds
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    gemms = [bounds.Span("gemm", 0.0, 1000.0, "[2, 66, 1]"),
             bounds.Span("gemm", 1010.0, 2010.0, "[2, 66, 1]")]  # fmt: skip
    assert bounds.matmul_phase(940.0, gemms) == 0.94  # in the first matmul's tail
    assert bounds.matmul_phase(1005.0, gemms) == 1.0  # between the two: a boundary
    assert bounds.matmul_phase(1110.0, gemms) == 0.1  # early in the second
    assert bounds.matmul_phase(5000.0, gemms) == 1.0  # after the last
