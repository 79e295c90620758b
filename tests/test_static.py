"""The static gates run inside the test suite, so `pytest` alone is the whole CI gate."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is not installed; run: pip install -e '.[dev,cpu]'"
    return found


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean() -> None:
    result = _run(_tool("ruff"), "check", "hicache_ref", "tests", "fuzz", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean_over_the_whole_package() -> None:
    # pyproject.toml: strict = true, pydantic plugin with init_typed / init_forbid_extra
    result = _run(_tool("mypy"), "--strict", "hicache_ref")
    assert result.returncode == 0, result.stdout + result.stderr
