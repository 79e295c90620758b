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
