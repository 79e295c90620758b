"""The reference in buffer mode: the same worlds and checks that judge upstream's (INV-41).

The reference's tier runs in ``buffer_only`` host memory (``controller/storage/buffer_mode.py``)
and its controller holds the tree's storage existence beliefs
(``controller/storage/existence_beliefs.py``), so the machine draws its ``storage:buffer_only``
worlds over the KV pool alone, and the harness judges them from its own record
(``harness/driver/storage_buffer.py``). The stories: the reference draws buffer and cache
worlds over the KV pool alone; its rate limit charges loads only and the write staging is freed
at the storage ack; a write is in flight until its storage ack and believed from it; a write
the backend failed is still believed, so writing it again is skipped; a page the backend lost
is forgotten by every rank once the agreed hit query misses it; a query one rank could not
answer teaches nothing and refutes nothing.
"""

from __future__ import annotations

from hypothesis import Phase, given, settings

from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.campaigns.machine import harness_configs
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.storage_snapshot import BeliefView

PAGE = 2


def buffer_session(host_pages: int = 8, ranks: int = 2) -> Session:
    impl = ReferenceImplementation()
    config = HarnessConfig(
        page_size=PAGE, layer_num=2, storage_ranks=ranks, storage_batch_pages=1,
        host_pages=host_pages, device_pages=16, storage_buffer_only=True,
    )  # fmt: skip
    return Session(config, impl, impl.name)


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    return outcome.text


def storage_of(session: Session) -> StorageDriver:
    assert session.storage is not None
    return session.storage


def views(session: Session) -> tuple[BeliefView, ...]:
    """Every rank's beliefs beside the harness's record (what INV-41 judges)."""
    book = storage_of(session).buffer
    assert book is not None
    return book.views()


def believed(session: Session, rank: int) -> tuple[str, ...]:
    return views(session)[rank].believed


def back_up_one_chain(session: Session) -> list[str]:
    """A chain of three pages written, backed up and acked on every rank; its page keys."""
    assert apply(session, "write_storage", pick=2, new=True).startswith("write_storage chain")
    while "backup" in {k.value for k in storage_of(session).runnable()}:
        apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    chain = next(iter(storage_of(session).chains.values()))
    return list(chain.keys)


def test_the_reference_draws_buffer_and_cache_worlds_over_the_kv_pool_alone() -> None:
    # 300 derandomized configurations of the reference -> storage worlds over the KV pool alone
    # in both host memory modes, and a buffer world never with a draft or a side pool
    modes: set[bool] = set()

    @settings(max_examples=300, database=None, derandomize=True, phases=[Phase.generate])
    @given(harness_configs(frozenset(ReferenceImplementation.capabilities)))
    def draw(config: HarnessConfig) -> None:
        if config.uses_storage and not config.has_draft and config.pool_group == "none":
            modes.add(config.storage_buffer_only)
        if config.storage_buffer_only:
            assert not config.has_draft and not config.has_side_pools, config

    draw()
    assert modes == {True, False}


def test_the_rate_limit_charges_loads_only_and_the_staging_is_freed_at_the_ack() -> None:
    # three host pages of two tokens: buffer mode's loads may fill int(0.9 * 6) = 5 tokens
    session = buffer_session(host_pages=3)
    cc = storage_of(session).l3.ranks[0].controller
    assert cc.host_memory_mode == "buffer_only" and cc.prefetch_capacity_limit == 5
    # write a three-page chain: all six host tokens are write staging, none a load's
    apply(session, "write_storage", pick=2, new=True)
    assert cc.mem_pool_host.available_size() == 0 and not cc.prefetch_rate_limited()
    # ... and with the staging charged (no tree to say what is staged) the pool is full
    staged = cc.host_write_staged_tokens_fn
    cc.host_write_staged_tokens_fn = None
    assert cc.prefetch_rate_limited()
    cc.host_write_staged_tokens_fn = staged
    # the storage ack frees the staging: the host pool is whole again, nothing staged
    while "backup" in {k.value for k in storage_of(session).runnable()}:
        apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    assert cc.mem_pool_host.available_size() == 6
    assert all(view.staged_tokens == 0 and not view.inflight for view in views(session))
    session.finish()


def test_a_write_is_in_flight_until_its_storage_ack_and_believed_from_it() -> None:
    session = buffer_session()
    apply(session, "write_storage", pick=2, new=True)
    assert all(len(v.inflight) == 3 and not v.believed for v in views(session))  # covered only
    while "backup" in {k.value for k in storage_of(session).runnable()}:
        apply(session, "storage_step", kind="backup")
    assert not believed(session, 0)  # the backup ran, its ack is not drained yet
    apply(session, "drain_backup_acks")
    assert all(len(v.believed) == 3 and not v.inflight for v in views(session))
    session.finish()


def test_a_write_the_backend_failed_is_still_believed_so_writing_it_again_is_skipped() -> None:
    # every rank's backend fails the chain's three pages: each acks 0 tokens, but the ack
    # teaches the write's pages unconditionally (TP-deterministic admission)
    session = buffer_session()
    storage = storage_of(session)
    for rank in storage.l3.ranks:
        assert rank.faults is not None
        rank.faults.arm("set_fail", 3)
    keys = back_up_one_chain(session)
    assert [c.state for c in storage.chains.values()] == ["none"]  # L3 holds none of it
    assert believed(session, 0) == believed(session, 1) == tuple(sorted(keys))
    again = apply(session, "write_storage", pick=0, new=False)
    assert again == "refused: every page believed stored or in flight (buffer mode skips it)"
    session.finish()


def test_a_page_the_backend_lost_is_forgotten_once_an_agreed_hit_query_misses_it() -> None:
    session = buffer_session()
    keys = back_up_one_chain(session)
    storage = storage_of(session)
    # rank 1's backend evicts the chain's last two pages; rank 0's keeps them
    faults = storage.l3.ranks[1].faults
    assert faults is not None
    for key in keys[1:]:
        faults.evict(key)
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")  # the drained hit: MIN(3, 1) = 1 page on every rank
    for rank in range(2):
        assert believed(session, rank) == (keys[0],), rank
        assert set(views(session)[rank].refuted) == set(keys[1:])
    session.finish()


def test_a_query_one_rank_could_not_answer_teaches_and_refutes_nothing() -> None:
    session = buffer_session()
    keys = back_up_one_chain(session)
    storage = storage_of(session)
    # rank 0's backend evicts the last two pages, rank 1's raises on the query: no verdict
    faults = storage.l3.ranks[0].faults
    other = storage.l3.ranks[1].faults
    assert faults is not None and other is not None
    for key in keys[1:]:
        faults.evict(key)
    other.arm("raise", 1)
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")  # the hit is MIN(1, 0) = 0, the verdict none
    for rank in range(2):
        assert believed(session, rank) == tuple(sorted(keys)), rank  # still the ack's
        assert not views(session)[rank].refuted
    session.finish()
