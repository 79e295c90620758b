"""CrossHair over every contract of the oracle and of pools/page_math (the CI gate of .ci/crosshair.sh).

CrossHair budgets are CPU seconds per condition; ``--report_all`` makes it print one line per
condition, so the gate proves each contract was exercised: every line must read "Confirmed over
all paths" or "Not confirmed" (explored, no counterexample), never an error or "Unable to meet
precondition" (which would mean nothing was checked, testing_anchors E11).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CROSSHAIR = str(Path(sys.executable).parent / "crosshair")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

TARGETS = [
    ("hicache_ref/oracle/geometry.py", 1),
    ("hicache_ref/oracle/state.py", 1),
    ("hicache_ref/oracle/streams.py", 1),
    ("hicache_ref/oracle/slots.py", 1),
    ("hicache_ref/oracle/write_path.py", 1),
    ("hicache_ref/oracle/contracts.py", 3),
    ("hicache_ref/oracle/storage/keys.py", 3),
    ("hicache_ref/formal/optimized.py", 1),
    ("hicache_ref/pools/page_math.py", 1),
]
FAST_TWINS = [
    (
        "hicache_ref.pools.page_math.compute_page_owner",
        "hicache_ref.formal.optimized.compute_page_owner_fast",
    ),
    (
        "hicache_ref.pools.page_math.compute_padded_len",
        "hicache_ref.formal.optimized.compute_padded_len_fast",
    ),
]


def _crosshair(*args: str) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [CROSSHAIR, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    lines = [ANSI.sub("", line) for line in (result.stdout + result.stderr).splitlines()]
    return result.returncode, [line for line in lines if line.strip()]


def test_every_contract_bearing_module_is_a_target() -> None:
    with_contracts = {
        str(path.relative_to(ROOT))
        for folder in ("hicache_ref/oracle", "hicache_ref/oracle/storage", "hicache_ref/formal")
        for path in (ROOT / folder).glob("*.py")
        if re.search(r"^\s+post: ", path.read_text(), re.MULTILINE)
    }
    assert with_contracts <= {target for target, _ in TARGETS}


@pytest.mark.parametrize(("target", "budget_s"), TARGETS, ids=[t for t, _ in TARGETS])
def test_every_contract_is_exercised_and_holds(target: str, budget_s: int) -> None:
    code, lines = _crosshair(
        "check",
        f"--per_condition_timeout={budget_s}",
        "--max_uninteresting_iterations=20",
        "--report_all",
        target,
    )
    verdicts = [line for line in lines if ": info: " in line]
    others = [line for line in lines if line not in verdicts]
    unexercised = [line for line in verdicts if "Unable to meet precondition" in line]
    assert code == 0 and not others, "\n".join(lines)
    assert verdicts and not unexercised, "\n".join(lines)


def test_planted_off_by_one_helpers_are_caught() -> None:
    code, lines = _crosshair(
        "check",
        "--per_condition_timeout=2",
        "tests/formal/planted/off_by_one_padding.py",
        "tests/formal/planted/drain_prefix_skips_gap.py",
    )
    out = "\n".join(lines)
    assert code == 1
    assert "false when calling compute_padded_len_planted(" in out
    assert "false when calling compute_drainable_prefix_planted(" in out


def test_a_planted_run_that_counts_past_a_hole_is_caught() -> None:
    code, lines = _crosshair(
        "check", "--per_condition_timeout=2", "tests/formal/planted/leading_run_past_hole.py"
    )
    out = "\n".join(lines)
    assert code == 1 and "false when calling compute_leading_run_planted(" in out, out


@pytest.mark.parametrize(("reference", "fast"), FAST_TWINS, ids=["page_owner", "padded_len"])
def test_fast_page_helpers_behave_like_the_reference(reference: str, fast: str) -> None:
    code, lines = _crosshair("diffbehavior", "--per_condition_timeout=2", reference, fast)
    assert code == 0 and any("No differences found" in line for line in lines), "\n".join(lines)


def test_diffbehavior_catches_a_mask_that_ignores_non_power_of_two_ranks() -> None:
    code, lines = _crosshair(
        "diffbehavior",
        "--per_condition_timeout=3",
        "hicache_ref.pools.page_math.compute_page_owner",
        "tests.formal.planted.mask_page_owner.compute_page_owner_mask",
    )
    assert code == 1 and any(line.startswith("Given:") for line in lines), "\n".join(lines)


@pytest.mark.campaign
@pytest.mark.parametrize(("target", "budget_s"), TARGETS, ids=[t for t, _ in TARGETS])
def test_contracts_hold_under_a_long_budget(target: str, budget_s: int) -> None:
    code, lines = _crosshair(
        "check",
        f"--per_condition_timeout={budget_s * 20}",
        "--max_uninteresting_iterations=200",
        target,
    )
    assert code == 0 and not lines, "\n".join(lines)
