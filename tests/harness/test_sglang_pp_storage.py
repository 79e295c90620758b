"""PP prefetch tickets on upstream 0.5.23: two PP ranks of its hybrid controller in one process.

In a PP world (``storage_pp``, capability ``storage:pp``) the harness runs 0.5.23's own
``submit_prefetch``, ``pp_prefetch_command_thread_func`` (its broadcast served on the harness's
PP command group), storage threads, ``take_ready_pp_prefetch`` and ``release_pp_prefetch``, with
the radix cache's PP half as ``driver/pp_tree.PpTree``. The stories: one ticket is staged by both
ranks with the same keys and hit and freed once taken; a ticket released before its completion is
freed by the sync thread; a reset stops both command threads (PP rank 0's broadcast of None ends
the follower's); the PP gate on the unmodified tree finds nothing; and each bug of
``sglang_bugs.BUGS_0523_PP``, planted in 0.5.23 at test time, is caught by INV-38 and shrunk to a
few steps (INV-30 for the shards sharing one namespace: a rank reads another's bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree, fork_tree
from hicache_ref.harness.campaigns.pp_gate import run_pp_gate
from hicache_ref.harness.driver.pp_tree import PpTree, pp_config

from .sglang_bugs import BUGS_0523_PP, PlantedBug
from .test_sglang_gate import SNIPPET_LINES_MAX

GATE_SECONDS = 8.0
BUG_SECONDS = 30.0


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def pp_tree(tree: Path) -> PpTree:
    return PpTree(SglangImplementation(tree), pp_config())


def test_pp_ranks_stage_one_ticket_and_free_it_on_0_5_23(tree_0523: Path) -> None:
    tree = pp_tree(tree_0523)
    chain = tree.back_up(3)
    rid = tree.submit(chain, 1)  # the first page is on the device: fetch the other two
    assert rid is not None and tree.command_step()
    for rank in range(2):  # every rank took the ticket, queried the two pages, holds their slots
        (ticket,) = tree.books[rank].tickets
        assert ticket.keys == chain.keys[1:] and ticket.hit_tokens == 4
        assert tree.held_by(rank, rid) == 4
    tree.run_until_idle()
    assert tree.check_progress(rid)
    tree.release(rid)
    assert all(tree.held_by(rank, rid) == 0 for rank in range(2))
    assert tree.checks.counts["INV-38"] > 0
    tree.finish()


def test_a_ticket_released_before_its_completion_is_freed_by_the_sync_thread(
    tree_0523: Path,
) -> None:
    tree = pp_tree(tree_0523)
    rid = tree.submit(tree.back_up(2), 0)
    assert rid is not None and tree.command_step()
    tree.release(rid)  # before the IO: the follower's relay carries the cancellation
    assert all(tree.held_by(rank, rid) == 4 for rank in range(2))
    assert tree.storage_step(StorageStepKind.IO)
    tree.run_until_idle()  # the sync threads publish the completion and free the slots
    assert all(tree.held_by(rank, rid) == 0 for rank in range(2))
    tree.finish()


def test_a_reset_stops_both_command_threads_and_the_next_epoch_runs(tree_0523: Path) -> None:
    tree = pp_tree(tree_0523)
    chain = tree.back_up(2)
    assert tree.submit(chain, 0) is not None
    tree.reset()  # the queued ticket is drained by the stopping threads, then the epoch ends
    rid = tree.submit(chain, 0)
    assert rid is not None and tree.command_step()
    assert [t.epoch for t in tree.books[1].tickets][-1] == 1
    tree.finish()


def test_the_pp_gate_finds_nothing_on_0_5_23(tree_0523: Path) -> None:
    report = run_pp_gate(SglangImplementation(tree_0523), seconds=GATE_SECONDS)
    assert not report.failed, (report.failure, report.program)
    assert report.cases > 20 and report.checks["INV-38"] > report.cases


@pytest.mark.parametrize("bug", BUGS_0523_PP, ids=lambda bug: bug.NAME)
def test_pp_bug_is_one_small_substitution(bug: type[PlantedBug], tree_0523: Path) -> None:
    source = (tree_0523 / bug.TARGET).read_text()
    assert bug.apply(source) != source
    assert bug.OLD.count("\n") <= SNIPPET_LINES_MAX and bug.NEW.count("\n") <= SNIPPET_LINES_MAX
    assert set(bug.INVARIANTS) <= {"INV-38", "INV-30", "INV-28"} and bug.INVARIANTS


@pytest.mark.parametrize("bug", BUGS_0523_PP, ids=lambda bug: bug.NAME)
def test_pp_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    target = Path(bug.TARGET)
    planted = fork_tree(
        bug.write_patched(tree_0523 / target, tmp_path / target.name), tree_0523, target
    )
    report = run_pp_gate(SglangImplementation(planted), seconds=BUG_SECONDS)
    assert report.failure_id in bug.INVARIANTS, (report.failure, report.program)
    assert report.program.count("(") <= 6, report.program  # shrunk to a handful of steps


def test_a_release_between_the_followers_receipt_and_its_state_is_honoured_under_points(
    tree_0523: Path,
) -> None:
    # points: the follower takes the ticket off the broadcast and parks before the state lock;
    # the request finishes right then (its relay binds TICKETED, the release makes it CANCELLED)
    tree = PpTree(SglangImplementation(tree_0523), pp_config(), points=True)
    rid = tree.submit(tree.back_up(2), 0)
    assert rid is not None
    assert tree.point(0)  # PP rank 0 takes the ticket: parked at its broadcast's put
    assert tree.point(0)  # the broadcast reaches the follower's inbox
    assert tree.point(1)  # the follower takes it: parked before pp_prefetch_state_lock
    at = tree.position(1)
    assert at is not None and at[1].kind == "lock", at
    assert rid not in tree.cc[1].pp_prefetch_states
    tree.release(rid)
    assert tree.cc[1].pp_prefetch_decisions[rid] is tree.hybrid.PPPrefetchDecision.CANCELLED
    tree.run_until_idle()  # the follower registers the ticket as released; its sync frees it
    assert all(tree.held_by(rank, rid) == 0 for rank in range(2))
    assert [t.ended for t in tree.books[1].tickets] == [True]
    tree.finish()


def test_the_state_machine_refuses_a_pp_world_and_names_the_pp_gate(tree_0523: Path) -> None:
    from hicache_ref.errors import HiCacheInputError
    from hicache_ref.harness.steps.session import Session

    implementation = SglangImplementation(tree_0523)
    config = implementation.refine_config(pp_config())
    assert config.storage_pp and "+pp" in config.describe()  # kept: 0.5.23 has storage:pp
    with pytest.raises(HiCacheInputError, match="run it with the PP gate"):
        Session(config, implementation, implementation.name)
