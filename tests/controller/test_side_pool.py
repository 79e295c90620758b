"""The reference's independent side pool (``controller/side_pool.py``, ``pool_group="swa"``).

A node's side rows and side host slots come from the side pool's own allocator and host pool,
never the anchor's (INV-36); a write or load the side pool cannot hold refuses as a whole and
leaves both pools as they were (INV-17), and so does a side copy that fails to launch; a side
host slot an unfinished copy uses is never released (INV-07); and a side pool whose allocator
hands out another pool's rows is refused at attach. Every byte of both pools is checked by the harness's own model (the session).
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.errors import HiCacheInputError, InvariantViolation, TransferLaunchError
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

PAGE = 4


def swa_session(**fields: int) -> Session:
    geometry = {"layer_num": 2, "draft_layer_num": 3, "side_device_pages": 6}
    geometry.update(fields)
    config = HarnessConfig(
        page_size=PAGE, pool_group="swa", draft_host_pages=fields.get("draft_host_pages", 6),
        **{k: v for k, v in geometry.items() if k != "draft_host_pages"},
    )  # fmt: skip
    return Session(config, ReferenceImplementation(), "reference")


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped and not outcome.refused, (rule, outcome)
    return outcome.text


def computed_node(session: Session, tokens: int = 8) -> int:
    handle = session.tree.next_handle
    apply(session, "prefill", tokens=tokens)
    while session.tree.batch:
        apply(session, "forward_layer")
    return handle


def controller_of(session: Session) -> HiCacheController:
    controller = session.world.ranks[0].controller
    assert isinstance(controller, HiCacheController)
    return controller


def test_a_node_round_trips_with_its_side_rows_and_slots_from_their_own_pools() -> None:
    # write -> both pools' slots, each from its own host pool -> evict -> load -> each pool's
    # rows from its own allocator; every side layer read waits for its own event
    session = swa_session()
    rank = session.world.ranks[0]
    h = computed_node(session)
    assert "side host 8 slots" in apply(session, "write", node=h)
    node = session.tree.nodes[h]
    assert node.side_host[0] is not None and rank.draft_host_pool is not None
    assert {int(s) // PAGE for s in node.side_host[0]} <= rank.draft_host_pool.allocated_pages()
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")  # both pools' host bytes checked (INV-06)
    apply(session, "evict_device", node=h)
    assert "side 8 rows" in apply(session, "load", node=h)  # INV-36 checked on the rows
    apply(session, "start_loading")
    for layer in range(3):
        apply(session, "forward_read", node=h, layer=layer, draft=True)
    for layer in range(2):
        apply(session, "forward_read", node=h, layer=layer, draft=False)
    session.finish()  # both pools' bytes at rest and pages (INV-05)


def test_a_side_host_pool_too_small_refuses_the_write_and_gives_the_anchor_slots_back() -> None:
    session = swa_session(draft_host_pages=1)
    h = computed_node(session)  # two pages: the side host pool holds one
    outcome = session.apply(Step(rule="write", args={"node": h}))
    assert outcome.refused  # the session compared both pools with before (INV-17)
    assert not session.world.ranks[0].host_pool.allocated_pages()
    assert not controller_of(session).write_queue and not controller_of(session).ack_write_queue
    session.finish()


def test_a_side_allocator_too_small_refuses_the_load_and_gives_the_anchor_rows_back() -> None:
    session = swa_session(side_device_pages=3)
    h = computed_node(session)
    apply(session, "write", node=h)
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    apply(session, "evict_device", node=h)
    computed_node(session, tokens=6)  # the new node takes two of the three side pages
    anchor_before = session.world.ranks[0].allocator.allocated_page_ids()
    outcome = session.apply(Step(rule="load", args={"node": h}))
    assert outcome.refused
    assert session.world.ranks[0].allocator.allocated_page_ids() == anchor_before
    assert not controller_of(session).load_queue and not controller_of(session).draft_load_queue
    session.finish()


def test_side_host_slots_are_not_released_while_their_backup_copy_is_in_flight() -> None:
    # write (D2H queued, not run) -> release the side slots: INV-07, nothing freed -> the copy
    # lands and its ack drains -> the release goes through
    session = swa_session()
    h = computed_node(session)
    apply(session, "write", node=h)
    controller = controller_of(session)
    side_host = session.tree.nodes[h].side_host[0]
    host_pool = session.world.ranks[0].draft_host_pool
    assert side_host is not None and host_pool is not None
    held = host_pool.allocated_pages()
    with pytest.raises(InvariantViolation, match="evict_side_host frees draft_host") as refusal:
        controller.evict_side_host(side_host)
    assert refusal.value.inv_id == "INV-07" and host_pool.allocated_pages() == held
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    assert controller.evict_side_host(side_host) == len(side_host)
    assert not host_pool.allocated_pages()


def test_a_side_pool_whose_allocator_serves_another_pool_is_refused_at_attach() -> None:
    # the anchor's allocator as the side pool's: INV-36 named in the refusal
    session = swa_session()
    rank = session.world.ranks[0]
    assert rank.draft_device_pool is not None and rank.draft_host_pool is not None
    fresh = ReferenceImplementation.controller_class(
        rank.allocator, rank.host_pool, PAGE, io_backend=session.config.io_backend
    )
    with pytest.raises(HiCacheInputError, match="INV-36"):
        fresh.attach_side_pool(rank.draft_device_pool, rank.draft_host_pool, rank.allocator)
    with pytest.raises(HiCacheInputError, match="unknown side pool 'indexer'"):
        fresh.attach_side_pool(
            rank.draft_device_pool, rank.draft_host_pool, rank.allocator, name="indexer"
        )
    # a Mamba state pool pages by single slots: an SWA world's pools (pages of 4) are refused
    assert rank.side_allocator is not None
    with pytest.raises(HiCacheInputError, match="must be 1"):
        fresh.attach_side_pool(
            rank.draft_device_pool, rank.draft_host_pool, rank.side_allocator, name="mamba"
        )
    assert fresh.side_pools is None and not fresh.has_draft_hicache


def test_a_write_without_the_side_pool_backs_up_the_anchor_alone() -> None:
    # a controller holding a side pool carries no draft pair: nothing rides along on the
    # anchor's indices, so a plain write moves the anchor's rows only
    session = swa_session()
    h = computed_node(session)
    controller = controller_of(session)
    node = session.tree.nodes[h]
    assert node.value is not None and not controller.has_draft
    host = controller.write(node.value, node_id=node.node_id)
    assert isinstance(host, torch.Tensor)
    assert not controller.draft_write_queue
    rank = session.world.ranks[0]
    assert rank.draft_host_pool is not None and not rank.draft_host_pool.allocated_pages()


def _raise_launch_fault(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected side launch fault")


def test_a_side_copy_that_fails_to_launch_rolls_back_both_pools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the side pool's D2H raises -> TransferLaunchError, both pools' slots free, no op or ack
    # left; healed -> the write goes through. The side H2D raises at start_loading -> both
    # load queues and the producer slot as before; healed -> the load lands (bytes checked)
    session = swa_session()
    controller = controller_of(session)
    rank = session.world.ranks[0]
    side_host_pool = rank.draft_host_pool
    assert side_host_pool is not None
    h = computed_node(session)
    node = session.tree.nodes[h]
    assert node.value is not None and node.side_value is not None
    with monkeypatch.context() as patch:
        patch.setattr(side_host_pool, "backup_from_device_all_layer", _raise_launch_fault)
        with pytest.raises(TransferLaunchError, match="injected side launch fault"):
            controller.write_with_side(node.value, node.node_id, node.side_value)
    assert not rank.host_pool.allocated_pages() and not side_host_pool.allocated_pages()
    assert not controller.write_queue and not controller.draft_write_queue
    assert not controller.ack_write_queue and not len(controller.inflight)
    apply(session, "write", node=h)
    apply(session, "synchronize", stream="write")
    apply(session, "drain_acks")
    apply(session, "evict_device", node=h)
    apply(session, "load", node=h)
    producer = controller.layer_done_counter.producer_index
    with monkeypatch.context() as patch:
        patch.setattr(side_host_pool, "load_to_device_per_layer", _raise_launch_fault)
        with pytest.raises(TransferLaunchError, match="injected side launch fault"):
            controller.start_loading()
    assert len(controller.load_queue) == len(controller.draft_load_queue) == 1
    assert controller.layer_done_counter.producer_index == producer
    assert not controller.ack_load_queue
    apply(session, "start_loading")
    apply(session, "synchronize", stream="load")
    apply(session, "drain_acks")  # both pools' device bytes (INV-06)
    session.finish()
