"""The reference's side pool in L3: the same worlds and checks that judge upstream's (INV-39).

The reference holds its independent side pool itself (``attach_side_pool``) and its tier
stores the pool's window (``controller/storage/side_window.py``), so the machine draws its
``storage:swa`` and ``storage:mamba`` worlds as it draws upstream's, and the harness judges
them from its own records (``harness/driver/storage_side*.py``). The stories: the reference
draws both kinds of world; a prefetched chain's window lands with the bytes written for its
trailing pages on every rank; a hit cut below the staged window keeps the served pages' window
and gives the rest back; a window covering the whole chain becomes its node's side slots and
loads back; a Mamba chain's state comes back as its node's state slot.
"""

from __future__ import annotations

from hypothesis import Phase, given, settings

from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.campaigns.machine import harness_configs
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.storage_snapshot import SideWindowRecord


def side_session(window: int, *, pool: str = "swa", pressure: bool = False) -> Session:
    impl = ReferenceImplementation()
    config = HarnessConfig(
        page_size=2, layer_num=2, draft_layer_num=2, pool_group=pool, storage_ranks=2,
        storage_batch_pages=2, host_pages=16, device_pages=16, side_device_pages=8,
        draft_host_pages=16, storage_swa_window=window, storage_host_pressure=pressure,
    )  # fmt: skip
    return Session(config, impl, impl.name)


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def to_l3(session: Session, pick: int) -> None:
    apply(session, "write_storage", pick=pick, new=True)
    for _ in range(4):  # a chain of up to three pages, two-page batches
        if "backup" in {k.value for k in session.storage.runnable()}:  # type: ignore[union-attr]
            apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")


def prefetch_to_the_end(session: Session, pick: int = 0) -> None:
    """Prefetch the first chain, then run its hit query, IO and sync steps and drain each."""
    apply(session, "prefetch", pick=pick)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    for _ in range(6):  # the IO's batches and the window read, their acks, then the final one
        for kind in ("io", "sync"):
            if kind in {k.value for k in session.storage.runnable()}:  # type: ignore[union-attr]
                apply(session, "storage_step", kind=kind)
        apply(session, "drain_prefetch_acks")
    apply(session, "drain_backup_acks")  # the side pool's release queue too


def windows_judged(session: Session) -> list[SideWindowRecord]:
    assert session.storage is not None
    return list(session.storage.log.side_windows)


def test_the_reference_draws_swa_and_mamba_storage_worlds() -> None:
    # 300 derandomized configurations of the reference -> both kinds of side-pool storage
    # world among them, each under host pressure (the cut the window is re-aligned to)
    drawn: set[tuple[str, bool]] = set()

    @settings(max_examples=300, database=None, derandomize=True, phases=[Phase.generate])
    @given(harness_configs(frozenset(ReferenceImplementation.capabilities)))
    def draw(config: HarnessConfig) -> None:
        if config.storage_swa_window:
            drawn.add((config.pool_group, config.storage_host_pressure))

    draw()
    assert drawn == {("swa", True), ("mamba", True)}


def test_a_prefetched_chain_lands_with_its_trailing_window_on_every_rank() -> None:
    # a 3-page chain backed up with its SWA pages, prefetched whole with a 2-page window
    session = side_session(2)
    to_l3(session, pick=2)
    prefetch_to_the_end(session)
    judged = windows_judged(session)
    assert [(w.rank, w.hit_pages, w.window_pages, w.published_pages) for w in judged] == [
        (0, 3, 2, 2),
        (1, 3, 2, 2),
    ]
    # pages 2 and 3's SWA bytes at the window's slots, the result kept, the slots back
    assert all(w.accepted and w.landed == (True, True) for w in judged)
    assert session.stats.checks_by_id["INV-39"] > 0
    assert session.storage is not None and not any(session.storage.side.held)
    session.finish()


def test_a_cut_hit_keeps_the_trailing_window_of_the_served_pages() -> None:
    # a 3-page window staged for a 3-page hit; other requests hold every rank's host room but
    # 2 pages while the query runs (the prefetch's pick 8), so the tree serves 2: the IO
    # shrinks the window to pages 1-2 and gives the third staged page back on the SWA release
    # queue
    session = side_session(3, pressure=True)
    to_l3(session, pick=2)
    prefetch_to_the_end(session, pick=8)
    judged = windows_judged(session)
    assert [(w.hit_pages, w.staged_pages, w.released_pages, w.window_pages) for w in judged] == [
        (2, 3, 1, 2),
        (2, 3, 1, 2),
    ]
    assert all(w.accepted and w.landed == (True, True) for w in judged)
    session.finish()


def test_a_window_covering_the_whole_chain_becomes_its_node_s_side_slots_and_loads() -> None:
    # a 2-page chain at the root with a 3-page window: the window is the whole chain, so the
    # prefetched node keeps it as its side host slots, and a load brings its SWA rows back
    session = side_session(3)
    to_l3(session, pick=1)
    prefetch_to_the_end(session)
    judged = [(w.hit_pages, w.window_pages, w.accepted) for w in windows_judged(session)]
    assert judged == [(2, 2, True)] * 2  # on both ranks
    node = session.tree.nodes[0]  # rank 0's prefetched node, the chain's handle
    assert node.side_host and node.side_host[0] is not None and node.side_host[0].numel() == 4
    assert session.storage is not None and not session.storage.side.held[0]  # the node's now
    apply(session, "load", node=0)
    apply(session, "start_loading")
    session.finish()  # the tree's byte checks read the node's rows, the side pool's too
    assert session.stats.checks_by_id["INV-06"] > 0 and session.stats.checks_by_id["INV-36"] > 0


def test_a_mamba_chain_s_state_comes_back_as_its_node_s_state_slot() -> None:
    # a 2-page chain's one state page under its last key, prefetched whole: one state slot
    session = side_session(1, pool="mamba")
    to_l3(session, pick=1)
    prefetch_to_the_end(session)
    judged = [(w.hit_pages, w.window_pages, w.accepted, w.landed) for w in windows_judged(session)]
    assert judged == [(2, 1, True, (True,))] * 2
    node = session.tree.nodes[0]
    assert node.side_host and node.side_host[0] is not None and node.side_host[0].numel() == 1
    apply(session, "load", node=0)
    apply(session, "start_loading")
    session.finish()
    assert session.stats.checks_by_id["INV-40"] > 0
