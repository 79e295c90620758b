"""Stateless model checking against implementations: every interleaving of a small storage world
runs against the reference's tier (and upstream 0.5.23's threads) through the schedule points,
passes on the unmodified code, and finds each planted window bug by construction, with a
shortest trace that ``hicache-fuzz replay`` runs again."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from hicache_ref.formal.explore_impl import WORLDS, explore, implementation_factory, main
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree, fork_tree
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace
from tests.harness.sglang_bugs import BUGS_0523_WINDOWS, PlantedBug

WINDOW_MUTANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "backup_acks_before_write": ("backup", ("INV-32",)),
    "reset_forgets_parked_threads": ("backup", ("INV-35",)),
    "io_ignores_termination": ("fetch", ("INV-33",)),
    "io_exception_doubles_final_ack": ("fetch", ("INV-25",)),
    "io_counts_past_hole": ("fetch_batch2", ("INV-34", "INV-19")),
}
"""Each window mutant of the catalogue: the world that holds its window, and the ids its
shortest run may fail with (``io_counts_past_hole`` dropped the termination check beside the
``break``, so its shortest run counts a page read after the settle's termination: INV-19)."""
BUG_WORLDS = {
    "backup_acks_before_write": "backup",
    "reset_leaves_backup_thread": "backup",
    "io_ignores_termination": "fetch",
    "io_exception_doubles_final_ack": "fetch",
    "io_counts_past_hole": "fetch_batch2",
}
"""The world of each bug of ``BUGS_0523_WINDOWS``."""
FIRST_IN_ONE_RANK = {"io_exception_doubles_final_ack": ("INV-05",)}
"""Ids a bug's shortest run in these one-rank worlds fails with beside those it declares (for
the gate's two-rank worlds): the tree drains both final acks and frees the bounce tail twice."""


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("hicache_ref").setLevel(logging.NOTSET)


def test_every_interleaving_of_one_backup_passes_on_the_reference() -> None:
    result = explore(implementation_factory("reference"), "reference", WORLDS["backup"])
    assert result.complete and result.violation is None, result.message
    # a backup of two pages, a fault at each write (hole, raise, defer) and a reset anywhere
    assert result.runs >= 20 and result.depth >= 6 and result.lockstep_steps > result.runs


@pytest.mark.parametrize("mutant", ["backup_acks_before_write", "reset_forgets_parked_threads"])
def test_a_backup_window_mutant_is_found_by_construction_and_replays(
    mutant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world_name, (inv_id,) = WINDOW_MUTANTS[mutant]
    name = f"mutant:{mutant}"
    result = explore(implementation_factory(name), name, WORLDS[world_name])
    assert result.violation is not None and result.inv_id == inv_id, result.summary()
    assert len(result.violation.steps) <= 3  # the write, a grant or two, the drain or reset
    # the trace is the harness's own: it replays without the explorer, and passes on the reference
    path = result.violation.write(tmp_path / "found.jsonl")
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")
    assert replay(Trace.read(path)).signature() == inv_id
    assert not replay(Trace.read(path), implementation="reference").failed


def test_a_termination_between_batches_is_found_by_construction_on_0_5_23(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the window the random 60 s gate needs 30-70 s for: one preemption, no drawn fault
    world = replace(WORLDS["fetch"], preemptions=1, max_faults=0)
    reference = explore(implementation_factory("reference"), "reference", world)
    assert reference.complete and reference.violation is None, reference.message
    tree = fetch_wheel_tree("0.5.23")
    bug = next(b for b in BUGS_0523_WINDOWS if b.NAME == "io_ignores_termination")
    target = Path(bug.TARGET)
    planted = fork_tree(bug.write_patched(tree / target, tmp_path / target.name), tree, target)
    result = explore(implementation_factory("sglang", str(planted)), "sglang", world)
    assert result.violation is not None and result.inv_id == "INV-33", result.summary()
    # its trace fails on the planted tree and passes on the unmodified one
    trace = Trace.read(result.violation.write(tmp_path / "found.jsonl"))
    assert replay(trace).signature() == "INV-33"
    assert not replay(trace, source=str(tree)).failed


def test_the_command_prints_the_trace_and_its_replay_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--impl", "mutant:backup_acks_before_write", "--world", "backup"]
    assert main([*argv, "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "violation INV-32 in 3 steps" in out and f"hicache-fuzz replay {tmp_path}" in out
    assert main(["--world", "nowhere"]) == 2  # bad input: one line, exit 2


@pytest.mark.campaign
def test_every_interleaving_of_one_prefetch_passes_on_the_reference() -> None:
    for world in ("fetch", "fetch_batch2"):
        result = explore(implementation_factory("reference"), "reference", WORLDS[world])
        assert result.complete and result.violation is None, result.message


@pytest.mark.campaign
@pytest.mark.parametrize("mutant", sorted(WINDOW_MUTANTS))
def test_every_window_mutant_is_found_by_construction(mutant: str) -> None:
    world_name, inv_ids = WINDOW_MUTANTS[mutant]
    name = f"mutant:{mutant}"
    result = explore(implementation_factory(name), name, WORLDS[world_name])
    assert result.violation is not None and result.inv_id in inv_ids, result.summary()


@pytest.mark.campaign
@pytest.mark.parametrize("bug", BUGS_0523_WINDOWS, ids=lambda bug: bug.NAME)
def test_every_window_bug_planted_in_0_5_23_is_found_by_construction(
    bug: type[PlantedBug], tmp_path: Path
) -> None:
    tree = fetch_wheel_tree("0.5.23")
    target = Path(bug.TARGET)
    planted = fork_tree(bug.write_patched(tree / target, tmp_path / target.name), tree, target)
    world = WORLDS[BUG_WORLDS[bug.NAME]]
    result = explore(implementation_factory("sglang", str(planted)), "sglang", world)
    expected = bug.INVARIANTS + FIRST_IN_ONE_RANK.get(bug.NAME, ())
    assert result.violation is not None and result.inv_id in expected, result.summary()


@pytest.mark.campaign
@pytest.mark.parametrize("world", ["backup", "fetch", "fetch_batch2"])
def test_every_interleaving_passes_on_upstream_0_5_23(world: str) -> None:
    source = str(fetch_wheel_tree("0.5.23"))
    result = explore(implementation_factory("sglang", source), "sglang", WORLDS[world])
    assert result.complete and result.violation is None, result.message
