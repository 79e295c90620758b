"""PP prefetch tickets with a Mamba state pool on upstream 0.5.21 - 0.5.23.

In a Mamba PP world (``pp_config(mamba=True)``: ``pool_group="mamba"``, a state pool whose pages
are one slot) every backup stores one state per chain, under the chain's last page key, and PP
rank 0's ticket names that one state page as 0.5.23's hybrid radix cache does (a one-key
``TRAILING_PAGES`` pool spec with no slots, on every ticket, mid-tree too): each rank's command
thread allocates one state slot of its own (``_allocate_pp_prefetch_buffers``, at the pool's own
page size), and its IO keys it by the served hit's last page. The stories: a ticket's state
round-trips each rank's own state bytes (the harness's model, ``pp_world.state_value``), from the
root and mid-chain; a state one rank's L3 lacks leaves every rank without a hit; a ticket holding
more state slots than its one page is caught by INV-38 on a hand-made record; the PP gate draws
Mamba worlds (only on a tree that stores a Mamba state in L3) and finds nothing on the unmodified
releases; the bug of ``sglang_bugs.BUGS_0523_PP_MAMBA``, planted at test time, is caught by it in
a Mamba world, while the gate's other worlds pass it; and the non-PP Mamba world's planted bug
(``BUGS_0523_MAMBA_STORAGE``) is caught on PP tickets too, by INV-39.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import STORAGE_MAMBA_CAPABILITY
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.campaigns.known_findings import ALL, get_known_findings
from hicache_ref.harness.campaigns.pp_gate import WORLDS, pp_worlds, programs, run_pp_gate
from hicache_ref.harness.driver.pp_side import side_pool_of
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_world import pp_config, state_value
from hicache_ref.harness.world.recording_storage import page_digest
from hicache_ref.invariants.checks_storage_pp import check_inv_38_pp_ticket_agreement
from hicache_ref.invariants.storage_snapshot import PpTicketRecord
from hicache_ref.storage.pool_transfers import MAMBA_POOL, component_key

from .sglang_bugs import BUGS_0523_MAMBA_STORAGE, BUGS_0523_PP_MAMBA, PlantedBug
from .test_sglang_pp_side import pp_snapshot
from .test_sglang_pp_storage import plant

GATE_SECONDS = 8.0
RELEASES = ("0.5.21", "0.5.22", "0.5.23")
BUG_CASES = 100
"""The planted Mamba PP bug's case budget: seed 0 catches it at case 12 (seeds 1 and 2: 4 and
62); a bound, not a cost (the gate ends at its first failure)."""
STATE_KEY_CASES = 100
"""The case budget of a gate of Mamba PP worlds alone on the non-PP Mamba bug (seed 0 catches
``single_state_key_not_realigned`` there at case 12)."""
OTHER_WORLDS_CASES = 150
"""Cases the gate's other worlds (anchor, sidecar, SWA) run on the planted tree, finding nothing:
the bug is a Mamba world's alone (300 such cases at seed 0 passed when measured)."""
WORLD_CASES = 40  # cases of a gate whose worlds are counted (seed 0 draws Mamba ones by then)
BUG_WALL_CAP_S = 900.0  # a wall-clock safety net only


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def mamba_tree(tree: Path) -> PpTree:
    return PpTree(SglangImplementation(tree), pp_config(mamba=True))


def state_bytes(tree: PpTree, rank: int, rid: str) -> tuple[float, str]:
    """The first element and the digest of the state slot rank ``rank`` staged for ``rid``."""
    (slot,) = tree.books[rank].side_staged[(tree.epoch, rid)]
    page = side_pool_of(tree.cc[rank]).get_data_page(slot, True)
    return float(page.flatten()[0]), page_digest(page)


@pytest.mark.parametrize("skip", [0, 1], ids=["at-the-root", "mid-chain"])
def test_a_mamba_ticket_round_trips_each_ranks_state(tree_0523: Path, skip: int) -> None:
    tree = mamba_tree(tree_0523)
    chain = tree.back_up(3)  # one state per chain, under its last page key, per rank
    assert {key for _, key in tree.expected_side} == {chain.keys[-1]}
    rid = tree.submit(chain, skip)
    assert rid is not None
    (spec,) = tree.cc[0].pp_prefetch_states[rid].ticket.pool_specs
    assert (spec.name.value, spec.num_slots, len(spec.keys)) == ("mamba", 0, 1)
    assert tree.command_step()
    for rank in range(2):  # each rank allocated one state slot of its own
        assert len(tree.books[rank].side_staged[(0, rid)]) == 1
        assert tree.snapshot().pp_tickets[rank][0].side_held_tokens == 1
    tree.run_until_idle()  # each IO read the state of the served hit's last page
    for rank in range(2):
        first, digest = state_bytes(tree, rank, rid)
        assert first == state_value(rank, chain.index)  # the rank's own state, not a KV page
        assert digest == tree.expected_side[(rank, chain.keys[-1])]
    assert tree.check_progress(rid)  # judged at the take (INV-39), then freed after its load
    assert tree.checks.counts["INV-39"] == 1
    tree.release(rid)
    assert all(not book.side_owners for book in tree.books)
    tree.finish()


def test_a_state_one_ranks_l3_lacks_leaves_no_hit(tree_0523: Path) -> None:
    tree = mamba_tree(tree_0523)
    chain = tree.back_up(2)
    faults = tree.storage.ranks[1].faults
    assert faults is not None
    faults.evicted.add(component_key(chain.keys[-1], MAMBA_POOL))  # rank 1 lost the state
    rid = tree.submit(chain, 0)
    assert rid is not None and tree.command_step()
    # a prefix is restorable only where L3 holds its state: no rank keeps a hit
    assert [tree.snapshot().pp_tickets[rank][0].hit_tokens for rank in range(2)] == [0, 0]
    tree.run_until_idle()
    assert tree.check_progress(rid) and tree.checks.counts["INV-39"] == 1  # nothing to lose
    tree.release(rid)
    assert all(not book.side_owners and not book.owners for book in tree.books)
    tree.finish()


def test_inv38_a_state_window_past_its_one_slot_is_caught() -> None:
    ticket = PpTicketRecord(
        "req-0", 0, ("k0",), 2, side_held_tokens=2, side_window_tokens=1, side_pool="mamba"
    )
    with pytest.raises(
        InvariantViolation, match=r"2 MAMBA side-pool slot\(s\) for a window of 1 slot"
    ):
        check_inv_38_pp_ticket_agreement(pp_snapshot(ticket))


@pytest.mark.parametrize("release", RELEASES)
def test_the_pp_gate_draws_mamba_worlds_and_finds_nothing(release: str) -> None:
    report = run_pp_gate(
        SglangImplementation(fetch_wheel_tree(release)),
        seconds=GATE_SECONDS,
        known=get_known_findings([ALL], "sglang"),
        release=release,
    )
    assert not report.failed, (report.failure, report.program)
    assert report.worlds.get("mamba", 0) > 5 and report.checks["INV-39"] > 0, report.worlds
    assert set(report.known_hits) <= ({"F22", "F26"} if release == "0.5.21" else set())


def test_a_tree_without_mamba_storage_is_drawn_no_mamba_pp_world(tree_0523: Path) -> None:
    implementation = SglangImplementation(tree_0523)
    assert pp_worlds(implementation.capabilities) == WORLDS  # 0.5.23 stores a Mamba state
    drawn = run_pp_gate(implementation, seconds=BUG_WALL_CAP_S, cases_max=WORLD_CASES)
    implementation.capabilities -= {STORAGE_MAMBA_CAPABILITY}  # a tree whose state stays out
    assert pp_worlds(implementation.capabilities) == ("anchor", "sidecar", "swa")
    report = run_pp_gate(implementation, seconds=BUG_WALL_CAP_S, cases_max=WORLD_CASES)
    assert drawn.worlds.get("mamba", 0) > 0 and not drawn.failed, drawn.worlds  # the same seed
    assert "mamba" not in report.worlds and not report.failed, report.worlds


@pytest.mark.parametrize("bug", BUGS_0523_PP_MAMBA, ids=lambda bug: bug.NAME)
def test_pp_mamba_bug_planted_in_0_5_23_is_caught_in_a_mamba_world_only(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=BUG_CASES)
    assert report.failure_id in bug.INVARIANTS, (report.failure, report.program)
    assert report.found is not None and report.found.mamba, report.program
    assert report.program.count("(") <= 4, report.program
    # the gate's other worlds, an SWA window's (of the KV's page) favoured, never see it
    others = programs(first_world=WORLDS.index("swa")).filter(lambda program: not program.mamba)
    passed = run_pp_gate(
        planted, seconds=BUG_WALL_CAP_S, cases_max=OTHER_WORLDS_CASES, drawn=others
    )
    assert not passed.failed and passed.worlds.get("swa", 0) > 0, (passed.failure, passed.worlds)


@pytest.mark.parametrize("bug", BUGS_0523_MAMBA_STORAGE, ids=lambda bug: bug.NAME)
def test_a_state_page_read_under_the_wrong_key_is_caught_on_the_pp_path(
    bug: type[PlantedBug], tree_0523: Path, tmp_path: Path
) -> None:
    # the non-PP Mamba world's planted bug (the one state's key never re-aligned to the served
    # hit's last page) on PP tickets: the IO reads the placeholder's state, finds none, and the
    # state L3 holds is lost: INV-39 from the harness's byte model of the state page
    planted = SglangImplementation(plant(bug, tree_0523, tmp_path))
    mamba = programs(first_world=WORLDS.index("mamba")).filter(lambda program: program.mamba)
    report = run_pp_gate(planted, seconds=BUG_WALL_CAP_S, cases_max=STATE_KEY_CASES, drawn=mamba)
    assert report.failure_id == "INV-39", (report.failure, report.program)
    assert report.program.count("(") <= 4, report.program
