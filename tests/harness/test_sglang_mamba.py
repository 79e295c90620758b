"""Mamba state pools (``pool_group="mamba"``): one state slot per node, beside the KV.

Upstream 0.5.19+'s ``HostPoolGroup`` takes a ``MAMBA`` entry whose transfers name one state
slot per node (``MambaComponent.build_hicache_transfers``); the gate runs 0.5.23's
``HybridCacheController`` and ``HostPoolGroup`` unmodified over the harness's own state pool
(in place of upstream's ``MambaPoolHost``, whose copies are sgl_kernel / triton kernels), and
the reference holds the same pool itself (``attach_side_pool(name="mamba")``). The stories: a
node round-trips with its state slot at an index of the state pool's own, on both; a host
state pool without a free slot refuses the whole write; the gate draws Mamba worlds on the
unmodified tree and finds nothing new; each bug of ``sglang_bugs.BUGS_0523_MAMBA``, planted in
0.5.23 at test time (a side pool sized by the KV's length: invisible to SWA's row per token), is
caught by INV-40 and its minimized trace passes on the unmodified tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import EXIT_OK
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

from .sglang_bugs import BUGS_0523_MAMBA, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught, run_gate
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

IMPLS = ("reference", "sglang")
MAMBA_GATE_BUDGET = "10s"


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def mamba_session(impl_name: str, tree: Path, **fields: object) -> Session:
    impl: Implementation = (
        ReferenceImplementation() if impl_name == "reference" else SglangImplementation(tree)
    )
    base: dict[str, object] = {
        "page_size": 4,
        "layer_num": 2,
        "draft_layer_num": 2,
        "pool_group": "mamba",
        "side_device_pages": 3,
        "draft_host_pages": 3,
    }
    config = HarnessConfig.model_validate({**base, **fields})
    return Session(impl.refine_config(config), impl, impl_name)


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


@pytest.mark.parametrize("impl_name", IMPLS)
def test_a_node_round_trips_with_one_state_slot_of_its_own(impl_name: str, tree_0523: Path) -> None:
    session = mamba_session(impl_name, tree_0523)
    rank = session.world.ranks[0]
    apply(session, "prefill", tokens=8)
    apply(session, "prefill", tokens=4)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    node = session.tree.nodes[0]
    assert node.side_value is not None and rank.side_allocator is not None
    assert rank.side_allocator.allocated_page_ids() == {1, 2}  # a slot per node, pages of one
    assert "host 8 slots, side host 1 slots" in apply(session, "write", node=0)
    side_host = node.side_host[0]
    assert side_host is not None and side_host.numel() == 1
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")  # the state slot's host bytes are checked here (INV-09)
    apply(session, "evict_device", node=0)
    assert rank.side_allocator.allocated_page_ids() == {2}  # the node's state slot went back
    assert "-> 8 locs, side 1 rows" in apply(session, "load", node=0)
    apply(session, "start_loading")
    for layer in range(2):  # each pool's layer waits by its own transfer id
        apply(session, "forward_read", node=0, layer=layer, draft=True)
        apply(session, "forward_read", node=0, layer=layer, draft=False)
    session.finish()  # both pools' bytes at rest and their pages (INV-05, INV-06)
    assert session.checks.counts["INV-36"] > 0


@pytest.mark.parametrize("impl_name", IMPLS)
def test_a_copy_on_write_load_fills_the_request_slot_the_tree_allocated(
    impl_name: str, tree_0523: Path
) -> None:
    session = mamba_session(impl_name, tree_0523, state_cow=True)
    allocator = session.world.ranks[0].side_allocator
    assert allocator is not None
    apply(session, "prefill", tokens=8)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    apply(session, "write", node=0)
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    apply(session, "evict_device", node=0)
    assert "and the request's state slot" in apply(session, "load", node=0)
    node = session.tree.nodes[0]
    assert node.side_request is not None and node.side_value is not None
    request, own = int(node.side_request[0]), int(node.side_value[0])
    assert request != own and allocator.allocated_page_ids() == {request, own}
    apply(session, "start_loading")
    apply(session, "synchronize", stream="load")
    before = session.checks.counts["INV-09"]
    apply(session, "drain_acks")  # the request slot holds the node's state (INV-09) ...
    assert session.checks.counts["INV-09"] > before
    assert node.side_request is None and allocator.allocated_page_ids() == {own}  # ... freed
    session.finish()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_two_copy_on_write_loads_in_one_start_loading_read_each_host_state_twice(
    impl_name: str, tree_0523: Path
) -> None:
    # one merged load op: each node's host slot goes to its own slot and its request's slot,
    # so the state copy's host slots repeat ([a, a, b, b]) while its device slots do not (a
    # false INV-40 at seed 100 before the pairing judged the device side of a load)
    session = mamba_session(impl_name, tree_0523, state_cow=True, side_device_pages=6)
    for _ in range(2):
        apply(session, "prefill", tokens=4)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    for node in (0, 1):
        apply(session, "write", node=node)
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    for node in (0, 1):
        apply(session, "evict_device", node=node)
    for node in (0, 1):
        apply(session, "load", node=node)
    apply(session, "start_loading")  # both loads in one operation
    apply(session, "synchronize", stream="load")
    apply(session, "drain_acks")  # both request slots hold their node's state (INV-09)
    session.finish()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_a_copy_on_write_load_without_a_free_state_slot_is_refused(
    impl_name: str, tree_0523: Path
) -> None:
    session = mamba_session(impl_name, tree_0523, state_cow=True, side_device_pages=2)
    apply(session, "prefill", tokens=4)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    apply(session, "write", node=0)
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    apply(session, "evict_device", node=0)
    apply(session, "prefill", tokens=4)  # node 1
    apply(session, "prefill", tokens=4)  # node 2: the state allocator's two slots are held
    outcome = session.apply(Step(rule="load", args={"node": 0}))
    assert outcome.refused and "no slot for the request" in outcome.text
    session.finish()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_a_full_host_state_pool_refuses_the_write_whole(impl_name: str, tree_0523: Path) -> None:
    session = mamba_session(impl_name, tree_0523, draft_host_pages=1)
    apply(session, "prefill", tokens=4)
    apply(session, "prefill", tokens=4)
    apply(session, "forward_layer")
    apply(session, "forward_layer")
    apply(session, "write", node=0)  # takes the one host state slot
    outcome = session.apply(Step(rule="write", args={"node": 1}))
    assert outcome.refused  # the session checked both pools are as before (INV-17)
    host = session.world.ranks[0].host_pool
    assert len(host.allocated_pages()) == 1  # node 0's page only: node 1's went back
    session.finish()


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_mamba_worlds_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, MAMBA_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    assert report["gate"]["passed"] and not report["failures"], stdout
    worlds = report["worlds"]["pool group"]  # what the pass covered, by share of cases
    assert worlds["mamba"]["cases"] > 0 and 0 < worlds["mamba"]["share"] < 1, worlds
    assert "mamba " in stdout and "independent Mamba state pool" in stdout


@pytest.mark.parametrize("bug", BUGS_0523_MAMBA, ids=lambda bug: bug.NAME)
def test_mamba_bug_is_one_small_substitution_in_one_file(
    bug: type[PlantedBug], tree_0523: Path
) -> None:
    check_one_small_substitution(bug, tree_0523)
    assert bug.INVARIANTS[0] in ("INV-40", "INV-05")


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_MAMBA, ids=lambda bug: bug.NAME)
def test_mamba_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)
