"""CI validates the shipped suite with ajv (npm), a JSON Schema validator that is not Python:
the format is standard JSON Schema, not only our pydantic models. ``.ci/run`` installs ajv
into ``.ci/node``; this test installs it there too when it is missing (npm is beside node)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hicache_ref.vectors.schema import shipped_schema_path
from hicache_ref.vectors.suite import shipped_suite_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "validate_vectors.cjs"
NODE_DIR = REPO / ".ci" / "node"
PACKAGES = ("ajv@8.20.0", "ajv-formats@3.0.1")  # as .ci/run installs them


@pytest.fixture(scope="module")
def node_path() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed here, so ajv cannot run (CI has node)")
    modules = NODE_DIR / "node_modules"
    if not (modules / "ajv").is_dir() or not (modules / "ajv-formats").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "node is installed without npm: install npm to fetch ajv"
        command = [npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(NODE_DIR)]
        subprocess.run([*command, *PACKAGES], check=True, timeout=300)
    return modules


def validate(node_path: Path, suite: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NODE_PATH": str(node_path)}
    command = ["node", str(SCRIPT), str(shipped_schema_path()), str(suite)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_ajv_validates_the_shipped_suite(node_path: Path) -> None:
    run = validate(node_path, shipped_suite_path())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("vectors valid")


def test_ajv_rejects_a_line_off_the_schema(node_path: Path, tmp_path: Path) -> None:
    lines = gzip.decompress(shipped_suite_path().read_bytes()).decode().splitlines()
    record = json.loads(lines[1])
    record["schedule"] = "whenever"
    lines[1] = json.dumps(record)
    suite = tmp_path / "bad.jsonl.gz"
    suite.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    run = validate(node_path, suite)
    assert run.returncode == 1
    assert "line 2: is not a Vector: /schedule" in run.stderr
