"""The timeout stop policy's PP-rank-0 verdict on a cache-mode prefetch, on upstream 0.5.21 - 0.5.23.

A prefetch without a PP ticket (cache mode) is polled on every PP rank at once; under ``timeout``
PP rank 0 alone reads its deadline and ``_all_reduce`` hands the verdict along PP. The PP gate
keeps one such prefetch per world (``driver/pp_verdict.PpVerdicts``) and runs the tree's own
``_can_terminate_prefetch`` / ``_all_reduce`` / ``_pp_sync`` on each rank over its own clock
(``adapters/sglang_verdict``). The stories: every rank returns PP rank 0's verdict, which is
what rank 0's clock says; 0.5.23 times the deadline from the first blocked poll and never cuts a
prefetch whose KV all landed, 0.5.21 from the operation's start; INV-38 catches a follower that
cuts alone and a rank 0 that ignores its clock, on hand-made records; a receive nobody sent is
INV-20; a tree without the verdict is polled not at all; the unmodified releases pass programs
that poll; and the bug of ``sglang_bugs.BUGS_0523_PP_VERDICT``, planted at test time, is caught
by the PP gate on a case budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.adapters.sglang_verdict import PpPipe, verdict_methods
from hicache_ref.harness.campaigns.pp_gate import PpOp, PpProgram, run_pp_gate, run_program
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_verdict import PpVerdicts
from hicache_ref.harness.driver.pp_world import pp_config
from hicache_ref.invariants.checks_storage_pp import check_inv_38_pp_ticket_agreement
from hicache_ref.invariants.storage_snapshot import PpVerdictRecord, StorageSnapshot

from .sglang_bugs import BUGS_0523_PP_VERDICT, PlantedBug
from .test_sglang_pp_storage import plant

RELEASES = ("0.5.21", "0.5.22", "0.5.23")
BUG_CASES = 40
"""The planted verdict bug's case budget: seed 0 catches it at case 3 (seeds 1 and 2: 11 and
6), shrunk to ``back_up(1) progress(0)``; a bound, not a cost (the gate ends at its first
failure)."""
BUG_WALL_CAP_S = 900.0  # a wall-clock safety net only


def world(release: str) -> Iterator[tuple[PpTree, PpVerdicts]]:
    source = fetch_wheel_tree(release)
    tree = PpTree(SglangImplementation(source), pp_config())
    try:
        yield tree, PpVerdicts(source, tree.hybrid, tree.page, len(tree.cc))
    finally:
        tree.storage.close()


@pytest.fixture(params=RELEASES)
def verdicts(request: pytest.FixtureRequest) -> Iterator[tuple[str, PpVerdicts]]:
    for _, polled in world(request.param):
        yield request.param, polled


def polls(verdicts: PpVerdicts, *picks: int) -> list[PpVerdictRecord]:
    for pick in picks:
        verdicts.poll(pick)
    return list(verdicts.take_records())


def verdict_snapshot(*records: PpVerdictRecord) -> StorageSnapshot:
    return StorageSnapshot(
        page_size=2, world_size=2, epoch=0, tiers=(), prefetches=((), ()), backups=((), ()),
        acks=((), ()), collectives=((), ()), pp_verdicts=records,
    )  # fmt: skip


# -- every rank returns PP rank 0's verdict ------------------------------------------------------
def test_every_pp_rank_returns_pp_rank_0s_verdict(verdicts: tuple[str, PpVerdicts]) -> None:
    # a 4-page prefetch (budget 2 s); PP rank 0's clock moves 1.5 s a poll, its follower's 0.5 s:
    # the follower's own clock never passes the budget, yet it cuts with PP rank 0
    release, polled = verdicts
    records = polls(polled, 3, 3, 3, 3)
    assert all(len(set(r.verdicts)) == 1 for r in records), records
    assert [r.deadline_passed for r in records] == [r.verdicts[0] for r in records]
    cut = next(r for r in records if r.verdicts[0])
    assert cut.clocks[1] < 2.0 < cut.clocks[0], cut
    # 0.5.21 - 0.5.22 time it from the operation's start, 0.5.23 from its first blocked poll
    assert cut.poll == (3 if release == "0.5.23" else 2), records
    check_inv_38_pp_ticket_agreement(verdict_snapshot(*records))
    assert polled.pipe.pending() == 0  # every send PP rank 0 made was received


def test_a_prefetch_whose_kv_landed_is_never_cut_on_0_5_23() -> None:
    # a 3-page prefetch (budget 1.75 s), a page landing each poll: by the time PP rank 0's
    # clock passed the budget every page landed, and 0.5.23 keeps it (nothing to salvage)
    for _, polled in world("0.5.23"):
        records = polls(polled, 6, 6, 6, 6)
        assert records[-1].clocks[0] > 1.75 and polled.landed == polled.pages == 3
        assert not any(any(r.verdicts) for r in records), records
        assert polled.operations  # still loading, on every rank


# -- INV-38 on hand-made records -----------------------------------------------------------------
def test_inv38_a_follower_cutting_alone_is_caught() -> None:
    # PP rank 1 decides on its own clock (3 s, past the 2 s budget); PP rank 0's (1 s) is not
    record = PpVerdictRecord("cache-1", 2, (False, True), False, (1.0, 3.0))
    with pytest.raises(InvariantViolation, match="PP rank 1 terminates but PP rank 0 keeps"):
        check_inv_38_pp_ticket_agreement(verdict_snapshot(record))
    check_inv_38_pp_ticket_agreement(
        verdict_snapshot(record.__class__("cache-1", 2, (False,) * 2, False))
    )


def test_inv38_a_rank_0_verdict_its_clock_contradicts_is_caught() -> None:
    record = PpVerdictRecord("cache-1", 4, (False, False), True, (2.5, 1.0))
    with pytest.raises(InvariantViolation, match="its own clock says the deadline passed"):
        check_inv_38_pp_ticket_agreement(verdict_snapshot(record))


def test_a_follower_receiving_a_verdict_never_sent_is_inv20() -> None:
    pipe = PpPipe()
    with pytest.raises(InvariantViolation, match=r"INV-20.*never sent"):
        pipe.recv(0, 1, torch.zeros(1, dtype=torch.int))
    pipe.send(0, 1, torch.ones(1, dtype=torch.int))
    into = torch.zeros(1, dtype=torch.int)
    pipe.recv(0, 1, into)
    assert int(into.item()) == 1 and pipe.pending() == 0


def test_a_tree_without_the_pp_rank_0_verdict_is_not_polled() -> None:
    # 0.5.19's unified radix cache has no PP-rank-0 verdict: the gate's polls do nothing there
    assert verdict_methods(fetch_wheel_tree("0.5.19")) is None
    assert verdict_methods(fetch_wheel_tree("0.5.23")) is not None


# -- the PP gate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_programs_that_poll_pass_on_the_unmodified_releases(release: str) -> None:
    ops = tuple(PpOp(verb, pick) for verb, pick in (("back_up", 1), ("progress", 3),
                ("fetch", 0), ("progress", 6), ("io", 0), ("progress", 1), ("progress", 0)))  # fmt: skip
    for points in (False, True):
        program = PpProgram(faults=False, backend="memory", points=points, ops=ops)
        tree = run_program(SglangImplementation(fetch_wheel_tree(release)), program)
        assert tree.checks.counts["INV-38"] > 0


@pytest.mark.parametrize("bug", BUGS_0523_PP_VERDICT, ids=lambda bug: bug.NAME)
def test_pp_verdict_bug_planted_in_0_5_23_is_caught(bug: type[PlantedBug], tmp_path: Path) -> None:
    planted = SglangImplementation(plant(bug, fetch_wheel_tree("0.5.23"), tmp_path))
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=BUG_CASES)
    assert report.failed and report.failure_id in bug.INVARIANTS, report
    assert "PP rank 1 terminates but PP rank 0 keeps loading" in report.failure, report.failure
