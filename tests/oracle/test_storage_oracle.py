"""The storage oracle, told as stories: a prefetch and a backup through every schedule point,
then the windows between the points, the rules that refuse an op, and each judge on a bad state."""

from __future__ import annotations

import random

import pytest

from hicache_ref.oracle.state import evolve, replace_at
from hicache_ref.oracle.step import OpNotEnabledError
from hicache_ref.oracle.storage import (
    BACKUP,
    HIT_QUERY,
    IO,
    SYNC,
    Advance,
    Clear,
    Collective,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
    LosePage,
    OpSpec,
    Prefetch,
    Reset,
    StorageConfig,
    StorageOp,
    StorageState,
    Terminate,
    WriteStorage,
    all_storage_ops,
    check_storage_invariants,
    enabled_storage_ops,
    initial_storage_state,
    run_storage_ops,
    storage_quiescent,
    storage_step,
    why_storage_disabled,
)
from hicache_ref.oracle.storage.keys import compute_chain_keys
from hicache_ref.oracle.storage.state import ABSENT, GOOD, INSERTED, THREADS, Thread
from hicache_ref.oracle.storage.step import successor_ops

ONE_RANK = StorageConfig(ranks=1, pages=2, ops=(OpSpec("prefetch", 2),), preloaded=(2,))
TWO_RANKS = StorageConfig(ranks=2, pages=2, ops=(OpSpec("prefetch", 2),), preloaded=(2, 1))
BACKUP_WORLD = StorageConfig(ranks=1, pages=2, ops=(OpSpec("backup", 2),), preloaded=(0,))

QUERY_BOTH_PAGES: tuple[StorageOp, ...] = (
    Prefetch(0),
    Advance(0, HIT_QUERY),  # prefetch_queue.get
    Advance(0, HIT_QUERY),  # batch_exists of page 0
    Advance(0, HIT_QUERY),  # batch_exists of page 1
    Collective("hits"),
    Advance(0, HIT_QUERY),  # prefetch_hit_queue.put
    DrainHits(),
    Advance(0, IO),  # prefetch_buffer.get
)
IO_PAGE = (Advance(0, IO), Advance(0, IO), Advance(0, IO))  # check, batch_get, progress put


def _clean(state: StorageState) -> bool:
    return not check_storage_invariants(state)


def _sync_all(state: StorageState, rank: int = 0) -> StorageState:
    """Run the sync thread (and the completion collective) until it has nothing left."""
    for _ in range(64):
        if why_storage_disabled(state, Advance(rank, SYNC)) is None:
            state, _ = storage_step(state, Advance(rank, SYNC))
        elif why_storage_disabled(state, Collective("completion")) is None:
            state, _ = storage_step(state, Collective("completion"))
        else:
            return state
    raise AssertionError("the sync thread did not run dry")


def test_a_full_prefetch_inserts_every_page_once_its_final_ack_is_drained() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), QUERY_BOTH_PAGES)
    assert state.ranks[0].prefetches[0].hit == 2 and state.ranks[0].threads[IO].point == "check"
    state = run_storage_ops(state, (*IO_PAGE, *IO_PAGE, Advance(0, IO)))  # + the final ack
    state = run_storage_ops(_sync_all(state), (DrainAcks(),))
    view = state.ranks[0].prefetches[0]
    assert view.published == 2 and view.final_drained == 1 and not view.current
    assert view.bounce == (GOOD, GOOD) and view.owner == (INSERTED, INSERTED)
    assert storage_quiescent(state) and _clean(state)


def test_a_termination_between_batches_freezes_progress_and_releases_the_tail_at_the_final_ack() -> (
    None
):
    state = run_storage_ops(initial_storage_state(ONE_RANK), (*QUERY_BOTH_PAGES, *IO_PAGE))
    state = run_storage_ops(_sync_all(state), (DrainAcks(), Terminate(0)))
    assert state.ranks[0].prefetches[0].published == 1
    state = run_storage_ops(state, (Advance(0, IO), Advance(0, IO), Advance(0, IO)))
    # the check saw the termination: no read, but the batch's ack and the final ack still go out
    assert state.ranks[0].threads[IO] == Thread()
    state = run_storage_ops(_sync_all(state), (DrainAcks(),))
    assert state.ranks[0].release_queue == ((0, 1),)
    state = run_storage_ops(state, (DrainReleases(),))
    assert storage_quiescent(state) and _clean(state)


def test_a_termination_while_a_read_is_in_flight_is_no_violation() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), QUERY_BOTH_PAGES)
    state = run_storage_ops(state, (Advance(0, IO), Advance(0, IO, "defer"), Terminate(0)))
    state = run_storage_ops(state, (Advance(0, IO),))  # the deferred batch_get returns
    view = state.ranks[0].prefetches[0]
    assert view.local == 0 and view.bounce == (ABSENT, ABSENT)  # not counted after termination
    assert _clean(state)


def test_a_hole_stops_progress_at_the_page_before_it() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), QUERY_BOTH_PAGES)
    state = run_storage_ops(state, (Advance(0, IO), Advance(0, IO, "hole", 0), Advance(0, IO)))
    state = run_storage_ops(state, (Advance(0, IO), Advance(0, IO), Advance(0, IO)))  # + final
    view = state.ranks[0].prefetches[0]
    assert view.first_hole == 0 and view.local == 0 and view.final_put == 1
    assert _clean(state)


def test_a_page_lost_between_the_query_and_the_read_is_a_miss_not_a_violation() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), (*QUERY_BOTH_PAGES, LosePage(0, 1)))
    state = run_storage_ops(state, (*IO_PAGE, *IO_PAGE))
    assert state.ranks[0].prefetches[0].local == 1 and _clean(state)


def test_two_ranks_publish_the_min_of_their_runs() -> None:
    state = initial_storage_state(TWO_RANKS)
    ops: list[StorageOp] = [Prefetch(0)]
    ops += [Advance(0, HIT_QUERY)] * 3 + [Advance(1, HIT_QUERY)] * 3
    state = run_storage_ops(state, (*ops, Collective("hits")))
    assert [r.threads[HIT_QUERY].value for r in state.ranks] == [1, 1]
    state = run_storage_ops(state, (Advance(0, HIT_QUERY), Advance(1, HIT_QUERY), DrainHits()))
    assert [len(r.prefetches[0].bounce) for r in state.ranks] == [1, 1] and _clean(state)


def test_a_collective_waits_for_every_rank() -> None:
    state = run_storage_ops(initial_storage_state(TWO_RANKS), (Prefetch(0), Advance(0, HIT_QUERY)))
    state = run_storage_ops(state, (Advance(0, HIT_QUERY), Advance(0, HIT_QUERY)))
    assert "rank 1's thread is not parked" in str(why_storage_disabled(state, Collective("hits")))
    assert "waits in an all_reduce" in str(why_storage_disabled(state, Advance(0, HIT_QUERY)))


def test_a_backup_acks_its_stored_prefix_and_stops_at_a_refused_batch() -> None:
    start = initial_storage_state(BACKUP_WORLD)
    state = run_storage_ops(start, (WriteStorage(0), Advance(0, BACKUP), Advance(0, BACKUP)))
    state = run_storage_ops(state, (Advance(0, BACKUP, "fail"), Advance(0, BACKUP)))
    assert state.ranks[0].backup_acks == ((0, 1),) and state.ranks[0].l3 == (GOOD, ABSENT)
    state = run_storage_ops(state, (DrainBackupAcks(),))
    assert not state.ranks[0].backups[0].source_held and _clean(state)


def test_a_backup_exception_still_acks_once() -> None:
    start = initial_storage_state(BACKUP_WORLD)
    state = run_storage_ops(
        start, (WriteStorage(0), Advance(0, BACKUP), Advance(0, BACKUP, "raise"))
    )
    state = run_storage_ops(state, (Advance(0, BACKUP), DrainBackupAcks()))
    assert state.ranks[0].backups[0].acks_drained == 1 and storage_quiescent(state)
    assert _clean(state)


def test_reset_joins_every_thread_and_drops_every_queue() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), (*QUERY_BOTH_PAGES, Advance(0, IO)))
    state = run_storage_ops(state, (Reset(),))
    assert state.epoch == 2 and state.fresh_epoch and _clean(state)
    assert all(t == Thread(epoch=2) for t in state.ranks[0].threads)
    assert state.ranks[0].l3 == (GOOD, GOOD)  # L3 outlives the process's state
    assert "each op is issued once" not in str(why_storage_disabled(state, Prefetch(0)))


def test_rules_name_what_refuses_an_op() -> None:
    state = initial_storage_state(ONE_RANK)
    assert "prefetch_queue is empty" in str(why_storage_disabled(state, Advance(0, HIT_QUERY)))
    assert "not a backup" in str(why_storage_disabled(state, WriteStorage(0)))
    assert "current prefetch" in str(why_storage_disabled(state, Terminate(0)))
    assert "outcome is one of" in str(
        why_storage_disabled(run_storage_ops(state, (Prefetch(0),)), Advance(0, HIT_QUERY, "raise"))
    )
    assert "draws clears" in str(why_storage_disabled(state, Clear(0)))
    with pytest.raises(OpNotEnabledError, match="DrainHits"):
        storage_step(state, DrainHits())


def test_the_fault_budget_bounds_outcomes_and_lost_pages() -> None:
    state = run_storage_ops(initial_storage_state(ONE_RANK), (LosePage(0, 1),))
    assert state.faults_left == 0
    assert "max_faults" in str(why_storage_disabled(state, LosePage(0, 0)))


def test_successor_ops_are_exactly_the_enabled_ops_of_the_universe() -> None:
    config = StorageConfig(
        ranks=2, pages=3, batch_pages=2, ops=(OpSpec("prefetch", 3), OpSpec("backup", 2)),
        preloaded=(3, 1), max_faults=2, detach=True, clear=True,
    )  # fmt: skip
    universe = all_storage_ops(config)
    for seed in range(40):
        rng = random.Random(seed)
        state = initial_storage_state(config)
        for _ in range(50):
            fast = successor_ops(state)
            assert set(fast) == set(enabled_storage_ops(state, universe))
            if not fast:
                break
            state, _ = storage_step(state, rng.choice(fast))


def test_chain_keys_commit_to_the_whole_prefix() -> None:
    keys = compute_chain_keys((1, 2, 3, 4, 5), 2, (9,))
    assert keys == ((9, 1, 2), (9, 1, 2, 3, 4))


# -- each judge on a bad state (built by hand: no step of the correct protocol reaches it) -----


def _with_view(state: StorageState, rank: int, **changes: object) -> StorageState:
    rank_state = state.ranks[rank]
    view = evolve(rank_state.prefetches[0], **changes)
    rank_state = evolve(rank_state, prefetches=replace_at(rank_state.prefetches, 0, view))
    return evolve(state, ranks=replace_at(state.ranks, rank, rank_state))


def _ids(state: StorageState) -> set[str]:
    return {v.inv_id for v in check_storage_invariants(state)}


def test_inv19_progress_past_a_hole_is_caught() -> None:
    state = _with_view(initial_storage_state(ONE_RANK), 0, first_hole=0, local=1)
    assert "INV-19" in _ids(state)


def test_inv21_progress_above_a_peers_is_caught() -> None:
    state = initial_storage_state(TWO_RANKS)
    state = _with_view(state, 0, bounce=(GOOD,), owner=(0,), published=1, local=1)
    state = _with_view(state, 1, bounce=(ABSENT,), owner=(0,), local=0)
    assert "INV-21" in _ids(state)


def test_inv29_hits_that_differ_across_ranks_are_caught() -> None:
    state = _with_view(initial_storage_state(TWO_RANKS), 0, hit=2, hit_local=2)
    state = _with_view(state, 1, hit=1, hit_local=1)
    assert "INV-29" in _ids(state)


def test_inv31_a_page_after_a_hole_in_l3_is_caught_unless_a_fault_lost_it() -> None:
    state = initial_storage_state(BACKUP_WORLD)
    rank = evolve(state.ranks[0], l3=(ABSENT, GOOD))
    state = evolve(state, ranks=(rank,))
    assert "INV-31" in _ids(state)
    assert "INV-31" not in _ids(evolve(state, lost=((0, 0),)))


def test_inv24_a_thread_kept_across_a_reset_is_caught() -> None:
    state = initial_storage_state(ONE_RANK)
    rank = evolve(state.ranks[0], threads=replace_at(state.ranks[0].threads, IO, Thread("get")))
    assert "INV-24" in _ids(evolve(state, ranks=(rank,), fresh_epoch=True))


def test_inv25_a_started_prefetch_without_its_final_ack_is_caught_at_quiescence() -> None:
    state = _with_view(initial_storage_state(ONE_RANK), 0, bounce=(GOOD,), owner=(0,))
    assert storage_quiescent(state) and "INV-25" in _ids(state)


def test_inv20_a_thread_stuck_in_a_collective_is_caught_at_quiescence() -> None:
    state = initial_storage_state(TWO_RANKS)
    stuck = replace_at(state.ranks[0].threads, SYNC, Thread("reduce", op=0))
    state = evolve(state, ranks=(evolve(state.ranks[0], threads=stuck), state.ranks[1]))
    assert storage_quiescent(state) and "INV-20" in _ids(state)


def test_every_thread_has_a_name() -> None:
    assert THREADS == ("hit_query", "io", "sync", "backup")
