"""PP prefetch tickets on upstream 0.5.23: two PP ranks of its hybrid controller in one process.

In a PP world (``storage_pp``, capability ``storage:pp``) the harness runs 0.5.23's own
``submit_prefetch``, ``pp_prefetch_command_thread_func`` (its broadcast served on the harness's
PP command group), storage threads, ``take_ready_pp_prefetch`` and ``release_pp_prefetch``, with
the radix cache's PP half as ``driver/pp_tree.PpTree``. The stories: one ticket is staged by both
ranks with the same keys and hit and freed once taken; a ticket released before its completion is
freed by the sync thread; a reset stops both command threads (PP rank 0's broadcast of None ends
the follower's); the PP gate on the unmodified tree finds nothing; and each bug of
``sglang_bugs.BUGS_0523_PP``, planted in 0.5.23 at test time, is caught by INV-38 and shrunk to a
few steps (INV-30 for the shards sharing one namespace: a rank reads another's bytes). The gate
command spends its PP share there (``campaign/pp_share.py``): on 0.5.23 its --json counts the PP
cases and it passes; with a PP bug planted it exits 1 with one replay line, and the program file
that line names fails on the planted tree and passes on the unmodified one.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hicache_ref.campaign.pp_share import PpShare, gate_pp_share
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.cli import main
from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree, fork_tree
from hicache_ref.harness.campaigns.pp_gate import PpOp, PpProgram, run_pp_gate, run_program
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_world import pp_config
from hicache_ref.harness.schedule.points import ALL_REDUCE, PAGE_WRITE, WAIT
from hicache_ref.replay_lines import get_cli_command

from .sglang_bugs import BUGS_0523_PP, BUGS_0523_PP_WINDOWS, PlantedBug
from .test_sglang_gate import SNIPPET_LINES_MAX

GATE_SECONDS = 8.0
BUG_CASES = 300
"""The planted PP bugs' case budget: the PP gate ends at its first failure, so a bound, not a
cost; seed 0 draws the same programs on a busy host and catches each by program 53
(benchmarks/RESULTS.md, the case budget)."""
WINDOW_BUG_CASES = 1500
"""A window inside a storage thread's body is a narrower target: caught at program 541 (a 60 s
wall budget ran 394 programs at load 20-80 and missed it)."""
BUG_WALL_CAP_S = 900.0
"""A wall-clock safety net only: a busy host makes a planted-bug PP gate slower, never blind."""
GATE_BUDGET = "6s"  # the gate command: a fifth of it on the PP gate
BUG_GATE_CASES = 100  # the gate command's: 80 to the state machine, 20 to the PP gate (caught: 3)
BUG_GATE_BUDGET = "900s"  # its wall-clock safety net


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


def refetch_assumed(tree: PpTree) -> str:
    """A chain backed up on every rank (its acks confirm the span) and one ticket of it taken,
    then a second request of the same span handed that end (storage_hit_end): submitted with
    assume_stored, as the radix cache does. Returns the second request."""
    chain = tree.back_up(2)
    assert tree.confirmed == {chain.index: 4}  # both ranks' backups acked the whole chain
    first = tree.submit(chain, 0)  # a request with no belief handed: queried as usual
    assert first is not None and first not in tree.assumed and tree.command_step()
    tree.run_until_idle()
    assert tree.check_progress(first)
    tree.release(first)
    again = tree.submit(chain, 0, assume=True)
    assert again is not None and again in tree.assumed
    tree.command_step()
    return again


def test_an_assume_stored_ticket_is_still_queried_by_every_pp_rank_on_0_5_23(
    tree_0523: Path,
) -> None:
    # 0.5.23's PP ticket has no assume_stored: every rank queries its own shard again
    tree = pp_tree(tree_0523)
    assert tree.assumes
    again = refetch_assumed(tree)
    for rank in range(2):
        ticket = tree.books[rank].ticket(again, 0)
        assert ticket is not None and len(ticket.keys) == 2 and ticket.hit_tokens == 4
    tree.finish()


def test_rank_zero_assuming_alone_is_caught_on_its_first_assumed_ticket(
    tree_0523: Path, tmp_path: Path
) -> None:
    (bug,) = [bug for bug in BUGS_0523_PP if bug.NAME == "pp_rank_zero_assumes_stored"]
    tree = pp_tree(plant(bug, tree_0523, tmp_path))
    with pytest.raises(InvariantViolation, match=r"but PP rank 0 queried \[\]") as info:
        refetch_assumed(tree)
    assert info.value.inv_id in bug.INVARIANTS


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
    check_pp_bug_is_caught(bug, tree_0523, tmp_path, BUG_CASES)


def check_pp_bug_is_caught(bug: type[PlantedBug], tree: Path, tmp_path: Path, cases: int) -> None:
    """The PP gate on ``tree`` with ``bug`` planted fails within ``cases`` programs (a wall
    clock of ``BUG_WALL_CAP_S`` as a safety net) under one of the bug's invariants, shrunk to a
    handful of steps."""
    planted = SglangImplementation(plant(bug, tree, tmp_path))
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=cases)
    assert report.failure_id in bug.INVARIANTS, (report.failure, report.program)
    assert report.program.count("(") <= 6, report.program  # shrunk to a handful of steps


def plant(bug: type[PlantedBug], tree: Path, tmp_path: Path) -> Path:
    """A fork of ``tree`` with ``bug`` planted in its target file."""
    target = Path(bug.TARGET)
    return fork_tree(bug.write_patched(tree / target, tmp_path / target.name), tree, target)


# -- the storage threads under schedule points -------------------------------------------------
def storage_points_tree(tree: Path, *, page_points: bool = True) -> PpTree:
    config = pp_config()
    return PpTree(
        SglangImplementation(tree), config, points=True, storage_points=True,
        page_points=page_points,
    )  # fmt: skip


def io_positions(tree: PpTree) -> list[str]:
    """Where each rank's IO thread parks now."""
    at = [c.storage.position(StorageStepKind.IO) for c in tree.cc]
    return [WAIT if a is None else a[1].kind for a in at]


def test_a_release_landing_at_an_io_page_write_is_honoured_under_storage_points(
    tree_0523: Path,
) -> None:
    # storage points: each rank's IO parks at its ticket's termination check, its read, the
    # page's own check and the page write; the request finishes right then
    tree = storage_points_tree(tree_0523)
    rid = tree.submit(tree.back_up(2), 0)
    assert rid is not None and tree.command_step()
    seen = []
    while PAGE_WRITE not in seen:
        assert tree.storage_step(StorageStepKind.IO)
        (here, there) = io_positions(tree)
        assert here == there  # every rank's IO thread moves one point per step
        seen.append(here)
    assert seen == ["lock", "batch_get", "lock", PAGE_WRITE]
    tree.release(rid)  # 0.5.23 only marks the ticket: its IO still writes the slots
    assert all(tree.held_by(rank, rid) == 4 for rank in range(2))
    assert tree.storage_to(StorageStepKind.IO, WAIT) > 0 and io_positions(tree) == [WAIT] * 2
    # the sync threads meet at their completion collective, on every rank at once
    assert tree.storage_to(StorageStepKind.SYNC, ALL_REDUCE) == 1
    tree.run_until_idle()  # the sync threads publish the completion and free the slots
    assert all(tree.held_by(rank, rid) == 0 for rank in range(2))
    assert not any(t.stray_writes for book in tree.books for t in book.tickets)
    tree.finish()


RELEASE_AT_A_PAGE_WRITE = (
    PpOp("back_up", 1), PpOp("fetch", 0), PpOp("io", 2), PpOp("release", 0), PpOp("io", 0),
)  # fmt: skip
"""A 2-page ticket staged on both ranks; every rank's IO runs on to its first page write
(``io(2)``), the request is released there, and the IO goes on."""


@pytest.mark.parametrize("bug", BUGS_0523_PP_WINDOWS, ids=lambda bug: bug.NAME)
def test_pp_window_bug_shows_only_with_a_point_inside_the_io_body(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    # the release at the IO's page write fails the planted tree, and only there: with the IO
    # parked at the lock points alone, or running whole bodies, the same program passes
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    story = PpProgram(False, "memory", True, RELEASE_AT_A_PAGE_WRITE, True, True)
    with pytest.raises(
        InvariantViolation, match=r"wrote the ticket's pages into host slot"
    ) as info:
        run_program(planted, story)
    assert info.value.inv_id in bug.INVARIANTS
    run_program(planted, replace(story, page_points=False))
    run_program(planted, replace(story, storage_points=False, page_points=False))
    run_program(SglangImplementation(tree_0523), story)  # the unmodified tree honours it


def test_a_ticket_carries_its_draft_sidecar_to_every_pp_rank(tree_0523: Path) -> None:
    # a draft pool riding on the KV's slots: the ticket's pool spec names it, every rank's
    # staged operation reads its pages on the KV's slots (batch_get_v2 beside each KV batch)
    tree = PpTree(SglangImplementation(tree_0523), pp_config(sidecar=True))
    rid = tree.submit(tree.back_up(2), 0)
    assert rid is not None
    (spec,) = tree.cc[0].pp_prefetch_states[rid].ticket.pool_specs
    assert (spec.name.value, spec.indices_from_pool.value, spec.num_slots) == ("draft", "kv", 0)
    assert tree.command_step()
    for controller in tree.cc:
        operation = controller.pp_prefetch_states[rid].operation
        (draft,) = operation.pool_transfers
        assert draft.host_indices.tolist() == operation.host_indices.tolist()
    tree.run_until_idle()
    for controller in tree.cc:  # a batch counts min(KV pages, sidecar pages) read
        assert int(controller.pp_prefetch_states[rid].operation.completed_tokens) == 4
    assert tree.check_progress(rid)
    tree.release(rid)
    tree.finish()


SIDECAR_READ_RELEASE = (
    PpOp("back_up", 1), PpOp("fetch", 0), PpOp("io", 1), PpOp("io", 1), PpOp("release", 0),
)  # fmt: skip
"""A 2-page ticket with a draft sidecar; every rank's IO runs to its KV read (``io(1)``), then
to its sidecar read; the request is released there."""


@pytest.mark.parametrize("bug", BUGS_0523_PP_WINDOWS, ids=lambda bug: bug.NAME)
def test_pp_window_bug_shows_at_the_sidecar_read_without_page_points(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    # 0.5.23's KV read re-checks termination before each page; the sidecar's batch_get_v2 lands
    # its pages without a look, so a release at that read reaches the freed slots at once
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    story = PpProgram(False, "memory", True, SIDECAR_READ_RELEASE, True, False, sidecar=True)
    with pytest.raises(InvariantViolation, match=r"slot\(s\) 4, 5, 6, 7, which") as info:
        run_program(planted, story)
    assert info.value.inv_id in bug.INVARIANTS
    run_program(planted, replace(story, storage_points=False))  # whole bodies: nothing lands
    run_program(SglangImplementation(tree_0523), story)  # the unmodified tree honours it


@pytest.mark.parametrize("bug", BUGS_0523_PP_WINDOWS, ids=lambda bug: bug.NAME)
def test_pp_window_bug_planted_in_0_5_23_is_caught_by_the_pp_gate(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    # the PP gate with the storage threads under points finds it (at a page write, or at a
    # draft sidecar's or an SWA window's read: neither looks at termination per page); the
    # program it found, with whole bodies, passes
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=WINDOW_BUG_CASES)
    assert report.failure_id in bug.INVARIANTS, (report.failure, report.program)
    found = report.found
    assert found is not None, report.program
    assert found.page_points or found.sidecar or found.swa_window, report.program
    run_program(planted, replace(report.found, storage_points=False, page_points=False))


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


# -- the gate command's PP share, and its replay line ----------------------------------------
def run_gate(
    tree: Path, out_dir: Path, budget: str, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, dict[str, Any], str]:
    """``hicache-fuzz gate --impl sglang --sglang-src TREE --workers 1 FLAGS``: (status,
    --json, stdout)."""
    report = out_dir / "gate.json"
    argv = ["gate", "--impl", "sglang", "--sglang-src", str(tree), "--budget", budget, *flags]
    argv += ["--out", str(out_dir), "--json", str(report), "--no-progress", "--workers", "1"]
    status = main(argv)
    return status, json.loads(report.read_text()), capsys.readouterr().out


def replay_line_path(stdout: str) -> Path:
    """The file the gate's one replay line names (its last word, as a shell splits it)."""
    (line,) = [line for line in stdout.splitlines() if f"{get_cli_command()} replay " in line]
    return Path(shlex.split(line)[-1])


@pytest.fixture
def no_src_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SRC_ENV, raising=False)  # --sglang-src sets it; restored at teardown


@pytest.mark.usefixtures("no_src_env")
def test_the_gate_spends_a_share_on_the_pp_gate_and_passes_on_0_5_23(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gate 0.5.23 (storage:pp) for 6 s -> the PP gate ran its share, found nothing, exit 0
    status, report, out = run_gate(tree_0523, tmp_path, GATE_BUDGET, capsys)
    assert status == 0, out
    pp = report["pp_gate"]
    assert pp["ran"] and pp["passed"] and pp["cases"] > 0 and pp["checks"]["INV-38"] > 0, pp
    assert pp["budget_s"] == pytest.approx(6 * pp["share"])
    assert report["gate"]["passed"] and not report["failures"]
    # the summary line rounds the PP gate's own seconds, the --json keeps them to a tenth
    said = re.search(r"PP gate cases \((\d+)s\)", out.splitlines()[-1])
    assert said is not None and abs(int(said.group(1)) - pp["seconds"]) <= 0.55, out


@pytest.mark.usefixtures("no_src_env")
def test_the_gate_gives_the_pp_gate_its_share_of_a_case_budget(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gate 0.5.23 with --max-cases 20 under a wall cap it never meets -> a fifth of the cases,
    # 4 programs, to the PP gate and 16 to the state machine; the summary names both budgets
    status, report, out = run_gate(tree_0523, tmp_path, "600s", capsys, "--max-cases", "20")
    assert status == 0, out
    assert (report["cases"], report["cases_max"]) == (16, 16)
    pp = report["pp_gate"]
    assert (pp["cases"], pp["cases_max"]) == (4, 4) and pp["passed"], pp
    assert "case budget: --max-cases 16 per worker, reached by 1 of 1 worker(s)" in out
    assert " 4 of 4 cases in " in out


@pytest.mark.usefixtures("no_src_env")
def test_a_pp_bug_fails_the_gate_with_a_replay_line_that_replays_it(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (bug,) = [bug for bug in BUGS_0523_PP if bug.NAME == "pp_follower_drops_last_hash"]
    target = Path(bug.TARGET)
    planted = fork_tree(
        bug.write_patched(tree_0523 / target, tmp_path / target.name), tree_0523, target
    )
    # gate the planted tree -> the PP gate's failure is new: exit 1, one replay line
    cases = ("--max-cases", str(BUG_GATE_CASES))
    status, report, out = run_gate(planted, tmp_path / "out", BUG_GATE_BUDGET, capsys, *cases)
    assert status == 1, out
    failure = report["pp_gate"]["failure"]
    assert failure["invariant"] in bug.INVARIANTS and report["failures"] == [failure], out
    assert f"gate: NEW {failure['invariant']} " in out
    program = replay_line_path(out)
    assert program == Path(failure["trace"]) and program.parent == tmp_path / "out"
    # the line's replay on the planted tree (its header's) -> the same invariant fails
    assert main(["replay", str(program)]) == 1
    replayed = capsys.readouterr().out
    assert replayed.splitlines()[-1].startswith(
        f"FAILED: InvariantViolation: {failure['invariant']}"
    )
    # ... and on the unmodified tree -> passes
    assert main(["replay", str(program), "--sglang-src", str(tree_0523)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("passed: ")


def test_the_pp_share_is_skipped_after_a_new_failure_unless_keep_going(tmp_path: Path) -> None:
    # a tree without storage:pp -> no share; with it, after a new failure -> not run, said why
    report = CampaignReport("sglang", "ci", 0)
    report.failures.append({"invariant": "INV-02", "error": "x", "trace": "", "seed": "0"})

    def share(capability: str, keep_going: bool) -> PpShare | None:
        tree = cast(Implementation, SimpleNamespace(capabilities=frozenset({capability})))
        return gate_pp_share(
            report, tree, impl="sglang", budget_s=10.0, seed=0, out_dir=tmp_path,
            keep_going=keep_going,
        )  # fmt: skip

    assert share("storage", keep_going=True) is None
    pp = share("storage:pp", keep_going=False)
    assert pp is not None and "--keep-going runs it" in pp.skipped
    assert pp.as_json()["ran"] is False and len(report.failures) == 1
