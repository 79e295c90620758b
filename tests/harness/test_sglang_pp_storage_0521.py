"""PP prefetch tickets on upstream 0.5.21 - 0.5.22, whose tickets carry PP rank 0's hit.

There PP rank 0's ``submit_prefetch`` queries every PP rank's shard (``extra_info`` names the
rank, as Mooncake answers it: the harness routes the query to that rank's backend), MIN-reduces
the hits and puts the result on the ticket; every rank's command thread stages that hit without
a query of its own. The harness attaches under the name "mooncake" (those releases open the PP
command group only for it) and keeps the generic page calls. The stories: both ranks stage the
carried hit and free it once taken; a hit is never more than a rank's own shard holds (INV-38),
which a follower whose shard lost a page shows; the PP gate on the unmodified trees finds
nothing new (0.5.21's F26 and F22, the IO or the backup thread dying of a backend exception,
are known findings, which the PP gate counts only inside their releases); and each bug of ``sglang_bugs.BUGS_0522_PP``, planted in 0.5.22, is caught by INV-38.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_ref.campaign.release_coverage import not_driven
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import STORAGE_PP_CAPABILITY
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.campaigns import pp_gate
from hicache_ref.harness.campaigns.known_findings import ALL, get_known_findings
from hicache_ref.harness.campaigns.pp_gate import PpProgram, run_pp_gate
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_world import pp_config

from .sglang_bugs import BUGS_0522_PP, PlantedBug
from .test_sglang_gate import SNIPPET_LINES_MAX
from .test_sglang_pp_storage import check_pp_bug_is_caught

RELEASES = ("0.5.21", "0.5.22")
GATE_SECONDS = 8.0
BUG_CASES = 300  # a bound, not a cost: the PP gate ends at its first failure (both: program 40)


@pytest.fixture(scope="module")
def tree_0522() -> Path:
    return fetch_wheel_tree("0.5.22")


@pytest.mark.parametrize("release", RELEASES)
def test_the_hit_carrying_releases_are_granted_a_pp_world(release: str) -> None:
    tree = fetch_wheel_tree(release)
    implementation = SglangImplementation(tree)
    assert STORAGE_PP_CAPABILITY in implementation.capabilities
    assert "pp prefetch" not in dict(not_driven(tree, implementation.capabilities))


def test_both_ranks_stage_the_carried_hit_and_free_it_on_0_5_22(tree_0522: Path) -> None:
    tree = PpTree(SglangImplementation(tree_0522), pp_config())
    assert tree.carries_hit
    chain = tree.back_up(3)
    rid = tree.submit(chain, 1)  # PP rank 0 queries both shards: the last two pages
    assert rid is not None and tree.command_step()
    for rank in range(2):  # no command thread queried; each staged the carried hit
        (ticket,) = tree.books[rank].tickets
        assert ticket.keys == () and ticket.hit_tokens == 4 and ticket.shard_tokens == 4
        assert tree.held_by(rank, rid) == 4
    tree.run_until_idle()
    assert tree.check_progress(rid)
    tree.release(rid)
    assert all(tree.held_by(rank, rid) == 0 for rank in range(2))
    tree.finish()


def test_a_follower_staging_past_its_own_shard_violates_inv_38(tree_0522: Path) -> None:
    tree = PpTree(SglangImplementation(tree_0522), pp_config())
    chain = tree.back_up(3)
    # rank 1's shard loses the chain's last page -> rank 0's query of both shards cuts the hit
    faults = tree.storage.ranks[1].faults
    assert faults is not None
    faults.evict(chain.keys[2])
    rid = tree.submit(chain, 0)
    assert rid is not None and tree.command_step()
    assert [tree.books[r].tickets[0].hit_tokens for r in range(2)] == [4, 4]
    # the same ticket judged as if rank 0 had carried its own shard's whole run -> INV-38
    for rank in range(2):
        tree.books[rank].tickets[0].hit_tokens = 6
    with pytest.raises(InvariantViolation, match=r"INV-38 .*rank 1's .*own shard held only the "):
        tree.check()
    tree.storage.close()


@pytest.mark.parametrize("release", RELEASES)
def test_the_pp_gate_finds_nothing_new_on_the_hit_carrying_releases(release: str) -> None:
    report = run_pp_gate(
        SglangImplementation(fetch_wheel_tree(release)),
        seconds=GATE_SECONDS,
        known=get_known_findings([ALL], "sglang"),
        release=release,
    )
    assert not report.failed, (report.failure, report.program)
    assert report.cases > 0 and report.checks["INV-38"] > 0
    # 0.5.21's storage threads die of a backend exception: the IO thread (F26) or, under a
    # backup's injected raise, the backup thread (F22); 0.5.22 catches both
    assert set(report.known_hits) <= ({"F22", "F26"} if release == "0.5.21" else set())


@pytest.mark.parametrize("bug", BUGS_0522_PP, ids=lambda bug: bug.NAME)
def test_pp_bug_planted_in_0_5_22_is_caught(
    bug: type[PlantedBug], tree_0522: Path, tmp_path: Path
) -> None:
    source = (tree_0522 / bug.TARGET).read_text()
    assert bug.apply(source) != source and bug.OLD.count("\n") <= SNIPPET_LINES_MAX
    check_pp_bug_is_caught(bug, tree_0522, tmp_path, BUG_CASES)


@pytest.mark.parametrize(("release", "counted"), [("0.5.21", True), ("0.5.22", False)])
def test_the_pp_gate_counts_a_known_finding_only_inside_its_releases(
    release: str, counted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every case dies as F26 does (0.5.10 - 0.5.21) -> counted on 0.5.21, a failure on 0.5.22
    def dies(implementation: Any, program: PpProgram, seed: int = 0) -> Any:
        raise InvariantViolation(
            "INV-25", "rank 1: upstream's prefetch_io_aux_func died of InjectedBackendError"
        )

    monkeypatch.setattr(pp_gate, "run_program", dies)
    report = run_pp_gate(
        SglangImplementation(fetch_wheel_tree(release)),
        seconds=0.5,
        known=get_known_findings([ALL], "sglang"),
        release=release,
    )
    assert (report.known_hits.get("F26", 0) > 0) is counted
    assert report.failed is not counted and report.failure_id == ("" if counted else "INV-25")
