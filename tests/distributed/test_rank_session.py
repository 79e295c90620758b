"""One CP rank alone in its process: its world holds that rank only, and the tree drives it.

A world built with ``only_ranks=[1]`` has one rank whose id is not its position; the tree
indexes by position and each rank's own ``cp_layout`` says what it owns, so a lone rank 1 runs
a full round trip, and its snapshot is labelled by position for the checks that index by it.
"""

from __future__ import annotations

from hicache_ref.distributed.rank_session import get_ready_prefix, open_rank_session
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

CONFIG = HarnessConfig(
    page_size=2, layer_num=2, pool_kind="nsa", cp_size=2, device_pages=16, host_pages=12, seed=3
)


def _step(rule: str, **args: int | bool | str) -> Step:
    return Step(rule=rule, args=dict(args))  # type: ignore[arg-type]


def test_lone_rank_one_of_two_runs_a_round_trip() -> None:
    # rank 1 alone: prefill 3 tokens (pages 0 and 1: rank 1 owns page 1) -> write -> drain ->
    # evict_device -> load -> reads -> quiescence, with every check of the session
    rank_session = open_rank_session(CONFIG, get_implementation("reference"), "reference", 1)
    session = rank_session.session
    assert [r.rank for r in session.world.ranks] == [1]
    steps = [
        _step("prefill", tokens=3, handle=0),
        _step("forward_layer"),
        _step("forward_layer"),
        _step("write", node=0),
        _step("synchronize", stream="write"),
        _step("drain_acks"),
        _step("evict_device", node=0),
        _step("load", node=0),
        _step("start_loading"),
        _step("forward_read", node=0, layer=1, draft=False),
    ]
    outcomes = [session.apply(step).text for step in steps]
    session.finish()
    assert "skipped" not in outcomes
    assert outcomes[5].startswith("drained 1 write ack(s)")
    (snapshot,) = session.snapshots()
    assert snapshot.rank == 0  # by position: the tree's model of holdings is indexed so
    assert len(snapshot.host_pages) == 1  # rank 1 holds the one page it owns


def test_drain_takes_the_agreed_minimum_of_ready_acks() -> None:
    # rank 0's write ack is ready here, but another rank had none ready: drain nothing now
    rank_session = open_rank_session(CONFIG, get_implementation("reference"), "reference", 0)
    session, drains = rank_session.session, rank_session.drains
    for step in (_step("prefill", tokens=4, handle=0), _step("forward_layer")):
        session.apply(step)
    session.apply(_step("forward_layer"))
    session.apply(_step("write", node=0))
    session.apply(_step("synchronize", stream="write"))
    controller = session.world.ranks[0].controller
    assert get_ready_prefix(controller, "ack_write_queue") == 1
    drains.agree([(1, 0), (0, 0)])
    assert session.apply(_step("drain_write")).text == "drained 0 write ack(s)"
    drains.release()
    assert session.apply(_step("drain_write")).text == "drained 1 write ack(s)"
