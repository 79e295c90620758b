"""PP prefetch tickets with an independent SWA side pool on upstream 0.5.23.

In an SWA PP world (``pp_config(swa_window=N)``: ``pool_group="swa"``, ``storage_swa_window``)
every backup stores each page's SWA rows beside its KV page, and PP rank 0's ticket names the
window as a ``TRAILING_PAGES`` pool spec with no slots: each rank's command thread allocates the
window from its own side pool (``_allocate_pp_prefetch_buffers``), its IO re-aligns it to the
served hit and gives the staged tail back. The stories: a ticket's window round-trips each
rank's own bytes; a rank whose shard holds more than the MIN hit stages a longer window and its
IO gives the tail back; a retired ticket keeping its window (INV-38) and a window of the wrong
pages (INV-39) are each caught by a checker on a hand-made record; the PP gate on the unmodified tree finds nothing;
and each bug of ``sglang_bugs.BUGS_0523_PP_SIDE``, planted at test time, is caught by it (in an SWA
world, or a Mamba one: the lines are every independent pool's).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from random import Random

import pytest
from hypothesis import Phase, find, settings
from hypothesis.errors import NoSuchExample

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.campaigns.pp_gate import (
    WORLDS,
    PpProgram,
    programs_of_round,
    run_pp_gate,
    world_of,
)
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_world import pp_config
from hicache_ref.invariants.checks_storage_pp import check_inv_38_pp_ticket_agreement
from hicache_ref.invariants.checks_storage_side import check_inv_39_side_window
from hicache_ref.invariants.storage_snapshot import (
    PpTicketRecord,
    SideWindowRecord,
    StorageSnapshot,
)

from .sglang_bugs import BUGS_0523_PP_SIDE, PlantedBug
from .test_sglang_pp_storage import plant

GATE_SECONDS = 8.0
BUG_CASES = 300
"""The planted PP side bugs' case budget: a bound, not a cost (the PP gate ends at its first
failure); seed 0 draws the same programs on a busy host and catches both by program 40
(benchmarks/RESULTS.md, the case budget)."""
BUG_WALL_CAP_S = 900.0  # a wall-clock safety net only


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def swa_tree(tree: Path, window: int) -> PpTree:
    return PpTree(SglangImplementation(tree), pp_config(swa_window=window))


def test_an_swa_ticket_round_trips_each_ranks_window_bytes(tree_0523: Path) -> None:
    tree = swa_tree(tree_0523, 2)
    rid = tree.submit(tree.back_up(3), 0)  # a 3-page span: the ticket names a 2-page window
    assert rid is not None
    (spec,) = tree.cc[0].pp_prefetch_states[rid].ticket.pool_specs
    assert (spec.name.value, spec.num_slots, len(spec.keys)) == ("swa", 0, 2)
    assert tree.command_step()
    for rank in range(2):  # each rank allocated the window from its own side pool
        assert len(tree.books[rank].side_staged[(0, rid)]) == 4
        assert tree.snapshot().pp_tickets[rank][0].side_held_tokens == 4
    tree.run_until_idle()
    assert tree.check_progress(rid)  # judged at the take: the trailing 2 pages, each rank's bytes
    assert tree.checks.counts["INV-39"] == 1
    tree.release(rid)
    assert all(not book.side_owners for book in tree.books)  # buffer mode freed the window
    tree.finish()


def test_a_longer_shard_stages_a_longer_window_and_gives_the_tail_back(tree_0523: Path) -> None:
    tree = swa_tree(tree_0523, 3)
    chain = tree.back_up(3)
    faults = tree.storage.ranks[1].faults
    assert faults is not None
    faults.evicted.add(chain.keys[2])  # rank 1's shard holds 2 pages, rank 0's all 3
    rid = tree.submit(chain, 0)
    assert rid is not None and tree.command_step()
    staged = [len(book.side_staged[(0, rid)]) for book in tree.books]
    assert staged == [6, 4]  # min(window, own hit) before the MIN
    tree.run_until_idle()  # rank 0's IO re-aligns the window to the 2-page hit: 1 page back
    assert [tree._side_held(rank, rid) for rank in range(2)] == [4, 4]
    assert tree.check_progress(rid)
    assert {slot for slot in tree.books[0].side_given_back[(0, rid)]} == set(
        tree.books[0].side_staged[(0, rid)][4:]
    )
    tree.release(rid)
    tree.finish()


def pp_snapshot(ticket: PpTicketRecord) -> StorageSnapshot:
    return StorageSnapshot(
        page_size=2, world_size=2, epoch=0, tiers=(), prefetches=((), ()), backups=((), ()),
        acks=((), ()), collectives=((), ()), pp_tickets=((ticket,), (ticket,)),
    )  # fmt: skip


def test_inv38_a_retired_ticket_keeping_its_window_is_caught() -> None:
    ticket = PpTicketRecord(
        "req-0", 0, ("k0",), 2, ready=True, retired=True,
        side_held_tokens=2, side_window_tokens=4, side_pool="swa",
    )  # fmt: skip
    with pytest.raises(InvariantViolation, match="still holds 2 SWA window slot"):
        check_inv_38_pp_ticket_agreement(pp_snapshot(ticket))
    check_inv_38_pp_ticket_agreement(pp_snapshot(replace(ticket, side_held_tokens=0)))


def test_inv38_a_window_past_its_spec_is_caught() -> None:
    ticket = PpTicketRecord(
        "req-0", 0, ("k0",), 2, side_held_tokens=6, side_window_tokens=4, side_pool="swa"
    )
    with pytest.raises(InvariantViolation, match="6 SWA side-pool slot"):
        check_inv_38_pp_ticket_agreement(pp_snapshot(ticket))


def test_inv39_a_pp_window_of_the_wrong_pages_is_caught() -> None:
    # a kept window whose second page holds bytes of a page the hit did not serve
    record = SideWindowRecord(
        rank=0, request_id="req-0", epoch=0, hit_pages=2, completed_pages=2, staged_pages=2,
        window_pages=2, released_pages=0, published_pages=2, landed=(True, False),
        stored=True, read_faulted=False, accepted=True,
    )  # fmt: skip
    snapshot = replace(pp_snapshot(PpTicketRecord("req-0", 0, (), 4)), side_windows=(record,))
    with pytest.raises(InvariantViolation, match=r"window page\(s\) \[1\]"):
        check_inv_39_side_window(snapshot)


def test_the_pp_gate_draws_swa_worlds_and_finds_nothing_on_0_5_23(tree_0523: Path) -> None:
    report = run_pp_gate(SglangImplementation(tree_0523), seconds=GATE_SECONDS)
    assert not report.failed, (report.failure, report.program)
    assert report.worlds.get("swa", 0) > 5 and report.checks["INV-39"] > 0, report.worlds


@pytest.mark.parametrize("bug", BUGS_0523_PP_SIDE, ids=lambda bug: bug.NAME)
def test_pp_side_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=BUG_CASES)
    assert report.failure_id in bug.INVARIANTS, (report.failure, report.program)
    found = report.found
    # only a world with an independent side pool shows it (an SWA window, or a Mamba state:
    # its window of one page is freed, and re-aligned, by the same lines)
    assert found is not None and (found.swa_window or found.mamba), report.program
    assert report.program.count("(") <= 6, report.program


def test_each_search_round_of_the_pp_gate_favours_another_world() -> None:
    """Hypothesis favours a strategy's first item; the gate rotates the worlds' order per round,
    so over three rounds every world is the most drawn once (an even share overall)."""
    favoured = []
    for round_index in range(len(WORLDS)):
        drawn: dict[str, int] = {}

        def count(program: PpProgram, drawn: dict[str, int] = drawn) -> bool:
            drawn[world_of(program)] = drawn.get(world_of(program), 0) + 1
            return False

        quick = settings(max_examples=300, database=None, phases=[Phase.generate])
        with pytest.raises(NoSuchExample):
            find(programs_of_round(round_index), count, settings=quick, random=Random(round_index))
        favoured.append(max(drawn, key=lambda world: drawn[world]))
    assert favoured == list(WORLDS)
