"""The gate catches bugs inside one loop body of upstream 0.5.23's storage threads.

Each bug of ``sglang_bugs.BUGS_0523_WINDOWS`` is one of issue 32's window classes planted in a
copy of 0.5.23's controller at test time: a backup that acks before it writes, an IO loop that
never looks at termination between batches, a ``continue`` past a hole, a handler that sends a
second final ack, a reset that never joins the backup thread. Before schedule points each
survived a 240 s gate (one loop body per step hid the window); now a default gate draws storage
worlds with points (``storage_points``), catches each by an invariant it declares, and its
minimized trace passes on the unmodified tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree

from .sglang_bugs import BUGS_0523_WINDOWS, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


@pytest.mark.parametrize("bug", BUGS_0523_WINDOWS, ids=lambda bug: bug.NAME)
def test_window_bug_is_one_small_substitution(bug: type[PlantedBug], tree_0523: Path) -> None:
    check_one_small_substitution(bug, tree_0523)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_WINDOWS, ids=lambda bug: bug.NAME)
def test_window_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)


@pytest.fixture
def gate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SRC_ENV, raising=False)  # --sglang-src sets it; restored at teardown
