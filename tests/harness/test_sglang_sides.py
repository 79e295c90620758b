"""Independent side pools (``pool_group="swa"``): upstream's ``HostPoolGroup`` with an SWA entry.

The SWA pool has its own device rows (the world's side allocator, the entry's
``device_alloc_fn``), its own host slots (its host pool's allocator, through
``resolve_host_transfers``) and its layers between the anchor's in the transfer ids. The
stories: a node round-trips with its side rows at indices of their own, its side layers waited
for by their own transfer ids; a side pool too small for a write or a load refuses the whole
call and leaves both pools as they were; a bounded gate of the unmodified 0.5.23 tree draws
side-pool worlds and finds nothing new; and each bug of ``sglang_bugs.BUGS_0523_SIDES``,
planted in 0.5.23's group or hybrid controller at test time, is caught by an invariant it
declares (INV-36 for slots from the anchor's allocator) and its minimized trace passes on the
unmodified tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import EXIT_OK
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.side_pools import side_layout

from .sglang_bugs import BUGS_0523_SIDES, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught, run_gate
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

SIDES_GATE_BUDGET = "10s"


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def swa_session(tree: Path, **fields: int) -> Session:
    impl = SglangImplementation(tree)
    geometry = {"layer_num": 2, "draft_layer_num": 2, "side_device_pages": 6}
    geometry.update(fields)
    config = HarnessConfig(
        page_size=4, pool_group="swa", draft_host_pages=fields.get("draft_host_pages", 6),
        **{k: v for k, v in geometry.items() if k != "draft_host_pages"},
    )  # fmt: skip
    return Session(impl.refine_config(config), impl, "sglang")


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def test_side_and_anchor_layers_interleave_in_the_transfer_ids() -> None:
    layout = side_layout(HarnessConfig(layer_num=2, draft_layer_num=3, pool_group="swa",
                                       side_device_pages=2, draft_host_pages=2))  # fmt: skip
    assert layout.side_ids == (0, 2, 4) and layout.kv_ids == (1, 3)
    kv, side = layout.mapper(side=False), layout.mapper(side=True)
    assert [kv(t) for t in range(5)] == [None, 0, None, 1, None]  # the anchor's holes
    assert [side(t) for t in range(5)] == [0, None, 1, None, 2]


def test_a_node_round_trips_with_its_side_rows_at_their_own_indices(tree_0523: Path) -> None:
    session = swa_session(tree_0523)
    rank = session.world.ranks[0]
    apply(session, "prefill", tokens=8)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    node = session.tree.nodes[0]
    assert node.side_value is not None and rank.side_allocator is not None
    # the tree took the side rows from the side pool's own allocator
    assert rank.side_allocator.allocated_page_ids() == {int(node.side_value[0]) // 4, 2}
    assert "side host 8 slots" in apply(session, "write", node=0)
    side_host = node.side_host[0]
    assert side_host is not None and rank.draft_host_pool is not None
    assert {int(s) // 4 for s in side_host} <= rank.draft_host_pool.allocated_pages()
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")  # the side host bytes are checked at the drain (INV-09)
    apply(session, "evict_device", node=0)
    assert not rank.side_allocator.allocated_page_ids()  # the side rows went back
    assert "side 8 rows" in apply(session, "load", node=0)
    apply(session, "start_loading")
    for layer in range(2):  # each waits by its own transfer id (the side layers: 0 and 2)
        apply(session, "forward_read", node=0, layer=layer, draft=True)
        apply(session, "forward_read", node=0, layer=layer, draft=False)
    session.finish()  # every byte of both pools at rest, and both pools' pages (INV-05, INV-06)


def test_a_side_host_pool_too_small_refuses_the_write_and_keeps_the_anchor_slots_free(
    tree_0523: Path,
) -> None:
    session = swa_session(tree_0523, draft_host_pages=1)
    apply(session, "prefill", tokens=8)  # two pages: the side host pool holds one
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    outcome = session.apply(Step(rule="write", args={"node": 0}))
    assert outcome.refused  # the session checked both pools are as before (INV-17)
    assert not session.world.ranks[0].host_pool.allocated_pages()
    session.finish()


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_side_pools_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, SIDES_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    assert report["gate"]["passed"] and not report["failures"], stdout
    worlds = report["worlds"]["pool group"]  # what the pass covered, by share of cases
    assert worlds["swa"]["cases"] > 0 and 0 < worlds["swa"]["share"] < 1, worlds
    assert "swa " in stdout and "independent SWA side pool" in stdout
    assert report["checks_by_id"].get("INV-36", 0) > 0  # reached here, not by the reference


@pytest.mark.parametrize("bug", BUGS_0523_SIDES, ids=lambda bug: bug.NAME)
def test_side_pool_bug_is_one_small_substitution_in_one_file(
    bug: type[PlantedBug], tree_0523: Path
) -> None:
    check_one_small_substitution(bug, tree_0523)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_SIDES, ids=lambda bug: bug.NAME)
def test_side_pool_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)
