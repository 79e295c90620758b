"""Each storage checker fires on a bad state and stays quiet on a healthy one (INV-19..INV-31,
INV-37).

The healthy state is a two-rank world after one prefetch of 16 tokens (rank 0 holds all four
pages, rank 1 two, so the published hit is 8 tokens) and one backup of two pages per rank.
Every test breaks one thing a real bug breaks and names the bug.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_storage import STORAGE_CHECKS, STORAGE_IDS
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.storage_snapshot import (
    BackupRecord,
    BouncePageEvent,
    ClearRecord,
    CollectiveRecord,
    KeyUse,
    L3Model,
    PrefetchRecord,
    ProgressAck,
    StaleAct,
    StorageSnapshot,
    StoreRead,
    StoreWrite,
    TierView,
    VerdictRecord,
)

PAGE = 4
P0 = (1, 2, 3, 4)
P1 = (*P0, 5, 6, 7, 8)
QUEUES = (("prefetch_queue", 0), ("ack_prefetch_queue", 0))


def prefetch(rank: int) -> PrefetchRecord:
    return PrefetchRecord(
        request_id="r",
        epoch=1,
        tokens=16,
        local_hit_tokens=16 if rank == 0 else 8,
        published_hit_tokens=8,
        hash_pages=2,
        bounce_tokens=8,
        published_progress=(4, 8),
        landed_pages=(1, 2),
        completed_now=8,
        final_acks=1,
        settled=True,
        released=((0, 8, "inserted"),),
        events=tuple(BouncePageEvent("r", page, "insert", 8, True) for page in (0, 1)),
        verdicts=(VerdictRecord("r", True, True, 8, 8),),
    )


def collectives(rank: int) -> tuple[CollectiveRecord, ...]:
    hits = (16,) if rank == 0 else (8,)
    return (
        CollectiveRecord(rank, "prefetch_hits", 0, "min", hits, (8,), 0),
        CollectiveRecord(rank, "prefetch_completion", 0, "min", (4,), (4,), 1),
        CollectiveRecord(rank, "prefetch_completion", 1, "min", (8,), (8,), 2),
    )


def l3() -> L3Model:
    keys = (("k0", P0), ("k1", P1))
    ranks = (0, 1)
    return L3Model(
        key_uses=tuple(
            KeyUse(r, key, prefix, how)
            for r in ranks
            for key, prefix in keys
            for how in ("stored", "queried")
        ),
        writes=tuple(
            StoreWrite(r, f"{key}_tp{r}", key, f"d{r}{key}") for r in ranks for key, _ in keys
        ),
        reads=tuple(StoreRead(r, key, f"d{r}{key}") for r in ranks for key, _ in keys),
        expected=tuple((r, key, f"d{r}{key}") for r in ranks for key, _ in keys),
        believed=tuple((r, key) for r in ranks for key, _ in keys),
        written=tuple((r, key) for r in ranks for key, _ in keys),
        present=tuple((r, key) for r in ranks for key, _ in keys),
    )


def healthy() -> StorageSnapshot:
    acks = (ProgressAck("r", 4, False), ProgressAck("r", 8, False), ProgressAck("r", None, True))
    return StorageSnapshot(
        page_size=PAGE,
        world_size=2,
        epoch=1,
        tiers=tuple(TierView(r, True, QUEUES, 0, 0) for r in (0, 1)),
        prefetches=((prefetch(0),), (prefetch(1),)),
        backups=tuple((BackupRecord(7, 1, 2, 2, 1, 8),) for _ in (0, 1)),
        acks=(acks, acks),
        collectives=(collectives(0), collectives(1)),
        l3=l3(),
        quiescent=True,
    )


def with_prefetch(snapshot: StorageSnapshot, rank: int, **changes: object) -> StorageSnapshot:
    prefetches = list(snapshot.prefetches)
    prefetches[rank] = (replace(prefetches[rank][0], **changes),)  # type: ignore[arg-type]
    return replace(snapshot, prefetches=tuple(prefetches))


def with_backup(snapshot: StorageSnapshot, rank: int, **changes: object) -> StorageSnapshot:
    backups = list(snapshot.backups)
    backups[rank] = (replace(backups[rank][0], **changes),)  # type: ignore[arg-type]
    return replace(snapshot, backups=tuple(backups))


def fires(inv_id: str, snapshot: StorageSnapshot, match: str) -> None:
    with pytest.raises(InvariantViolation, match=match) as info:
        STORAGE_CHECKS[inv_id](snapshot)
    assert info.value.inv_id == inv_id


def test_a_healthy_world_passes_every_storage_check() -> None:
    CheckRunner().run_all(STORAGE_IDS, healthy())
    assert sorted(STORAGE_CHECKS) == [
        *(f"INV-{n}" for n in range(19, 36)),
        "INV-37",
        "INV-38",
        "INV-39",
        "INV-41",
    ]


# -- INV-19 ---------------------------------------------------------------------------------------
def test_inv19_progress_counting_a_page_before_its_bytes_is_caught() -> None:
    # sglang#8901: completed_tokens incremented before the page bytes were set
    fires("INV-19", with_prefetch(healthy(), 0, landed_pages=(1, 1)), "more than the 1 pages")


def test_inv19_an_io_ack_put_before_its_pages_landed_is_caught() -> None:
    # the IO's second ack counted one more page when it was put, whose bytes had not landed
    bad = with_prefetch(healthy(), 0, io_counted=((0, 4, 1), (4, 8, 0)))
    fires("INV-19", bad, r"counted tokens \[4:8\) when it was put, but only 0 of those 1")
    CheckRunner().run_all(["INV-19"], with_prefetch(healthy(), 0, io_counted=((0, 8, 2),)))


def test_inv19_progress_moving_after_termination_is_caught() -> None:
    bad = with_prefetch(healthy(), 1, terminated_at=4, completed_now=8)
    fires("INV-19", bad, "returned 4, completed_tokens is now 8")


def test_inv19_a_bounce_range_given_back_twice_is_caught() -> None:
    # sglang#13483: the tail released by two threads
    bad = with_prefetch(healthy(), 0, released=((0, 8, "inserted"), (4, 8, "released")))
    fires("INV-19", bad, "given back twice")


def test_inv19_a_leaked_tail_is_caught() -> None:
    bad = with_prefetch(healthy(), 0, bounce_tokens=12, published_hit_tokens=8)
    fires("INV-19", bad, "end at 8 but the bounce buffer has 12")


def test_inv19_a_retired_prefetch_still_holding_bounce_pages_at_quiescence_is_caught() -> None:
    # the final ack came and the tree took the prefetch out, but a page of its buffer was
    # neither inserted nor released: the record never settles, so only quiescence can tell
    bad = with_prefetch(
        healthy(), 0, settled=False, retired=True, released=((0, 4, "inserted"),), unreturned=(4, 5)
    )
    fires("INV-19", bad, r"retired with bounce tokens \[4, 5\] neither inserted nor released")
    # while queues still run, the same record is only unsettled
    CheckRunner().run_all(["INV-19"], replace(bad, quiescent=False))


# -- INV-20 ---------------------------------------------------------------------------------------
def test_inv20_a_rank_issuing_an_extra_collective_is_caught() -> None:
    # sglang#30760: a reduction per batch, whose count depends on rank-local hits
    extra = CollectiveRecord(0, "prefetch_hits", 1, "min", (4,), (4,), 0)
    bad = replace(healthy(), collectives=((*collectives(0), extra), collectives(1)))
    fires("INV-20", bad, r"group prefetch_hits: ranks issued \[2, 1\]")


def test_inv20_a_wrong_reduction_result_is_caught() -> None:
    wrong = (replace(collectives(0)[0], result=(16,)), *collectives(0)[1:])
    bad = replace(healthy(), collectives=(wrong, collectives(1)))
    fires("INV-20", bad, "collective #0")


# -- INV-21 ---------------------------------------------------------------------------------------
def test_inv21_publishing_a_ranks_own_progress_is_caught() -> None:
    # sglang#27010: the tree inserted by rank-local completed_tokens
    local = (ProgressAck("r", 8, False), ProgressAck("r", 8, False), ProgressAck("r", None, True))
    bad = replace(healthy(), acks=(local, healthy().acks[1]))
    fires("INV-21", bad, "ack #0 differs across ranks")


def test_inv21_progress_that_is_not_the_min_is_caught() -> None:
    acks = (ProgressAck("r", 8, False),)
    completion = CollectiveRecord(0, "prefetch_completion", 0, "min", (8,), (8,), 1)
    slow = CollectiveRecord(1, "prefetch_completion", 0, "min", (4,), (8,), 1)
    bad = replace(healthy(), acks=(acks, acks), collectives=((completion,), (slow,)))
    fires("INV-21", bad, r"published progress 8 .* progress was \[8, 4\]")


# -- INV-22 ---------------------------------------------------------------------------------------
def test_inv22_complete_before_the_hit_was_published_is_caught() -> None:
    # sglang#9397: 0 == 0 counted as done before the hit query ran
    verdict = VerdictRecord("r", True, False, 0, None)
    fires("INV-22", with_prefetch(healthy(), 0, verdicts=(verdict,)), "hit unpublished")


# -- INV-23 ---------------------------------------------------------------------------------------
def test_inv23_a_tail_page_freed_before_the_final_ack_is_caught() -> None:
    # sglang#27550: the buffer released while the IO thread still wrote it
    event = BouncePageEvent("r", 1, "free", 4, False)
    fires("INV-23", with_prefetch(healthy(), 1, events=(event,)), "freed before the final ack")


def test_inv23_inserting_an_unpublished_page_is_caught() -> None:
    event = BouncePageEvent("r", 1, "insert", 4, True)
    fires("INV-23", with_prefetch(healthy(), 0, events=(event,)), "inserted bounce page 1")


# -- INV-24 ---------------------------------------------------------------------------------------
def test_inv24_an_old_epoch_op_surfacing_after_reset_is_caught() -> None:
    # sglang#36882: an old IO thread drained the new queue
    bad = replace(healthy(), stale=(StaleAct(0, "io step", "prefetch 'r'", 0),))
    fires("INV-24", bad, "from epoch 0 after the harness moved to epoch 1")


def test_inv24_a_release_queue_surviving_reset_is_caught() -> None:
    # sglang#26009: the release queue and the occupancy survived reset
    tiers = (TierView(0, True, (("host_mem_release_queue", 2),), 16, 0), healthy().tiers[1])
    fires("INV-24", replace(healthy(), tiers=tiers, just_reset=True), "after reset")


def test_inv24_a_thread_alive_after_detach_is_caught() -> None:
    tiers = (TierView(0, False, QUEUES, 0, 1), TierView(1, False, QUEUES, 0, 0))
    fires("INV-24", replace(healthy(), tiers=tiers, detached=True), "1 storage threads alive")


# -- INV-25 ---------------------------------------------------------------------------------------
def test_inv25_a_backup_never_acked_is_caught_at_quiescence() -> None:
    # sglang#38427: a backend exception killed the backup thread
    fires("INV-25", with_backup(healthy(), 0, acks=0, acked_tokens=None), "acked 0 times")


def test_inv25_two_final_acks_are_caught() -> None:
    fires("INV-25", with_prefetch(healthy(), 0, final_acks=2), "2 final acks")


# -- INV-26 ---------------------------------------------------------------------------------------
def test_inv26_an_ack_past_the_first_failed_batch_is_caught() -> None:
    # sglang#39701: a backup stopped at a failed batch but acked normally
    fires("INV-26", with_backup(healthy(), 1, stored_pages=1), "acked 8 tokens but .* first 1")


def test_inv26_a_skipped_rank_acks_its_span_only_with_its_mamba_state_stored() -> None:
    # MLA rank 1 stores no KV page; in a Mamba world it stores its own (sharded) state and
    # acks the span when every state page is stored (should_backup's MAMBA rule), else nothing
    skipped = with_backup(healthy(), 1, stored_pages=0, skipped=True, state_stored=True)
    STORAGE_CHECKS["INV-26"](skipped)
    lost = with_backup(skipped, 1, state_stored=False)
    fires("INV-26", lost, "acked 8 tokens but .* first 0")


def test_inv26_a_belief_in_an_unwritten_page_is_caught() -> None:
    model = replace(healthy().l3, believed=(*healthy().l3.believed, (0, "k9")))
    fires("INV-26", replace(healthy(), l3=model), "believes page k9 is in L3")


# -- INV-27 ---------------------------------------------------------------------------------------
def test_inv27_a_key_that_restarts_the_chain_is_caught() -> None:
    # sglang#35269: a node made before attach chained its keys from itself, not the root
    other = KeyUse(0, "k0", (9, 9, 9, 9, 1, 2, 3, 4), "stored")
    model = replace(healthy().l3, key_uses=(*healthy().l3.key_uses, other))
    fires("INV-27", replace(healthy(), l3=model), "names two prefixes")


def test_inv27_write_and_query_keys_that_differ_are_caught() -> None:
    other = KeyUse(1, "k0-bigram", P0, "queried")
    model = replace(healthy().l3, key_uses=(*healthy().l3.key_uses, other))
    fires("INV-27", replace(healthy(), l3=model), "a stored and a queried page must hash alike")


# -- INV-28 ---------------------------------------------------------------------------------------
def test_inv28_two_ranks_writing_one_key_are_caught() -> None:
    # sglang#10969: keys without the rank; ranks overwrote each other
    model = replace(
        healthy().l3, writes=(StoreWrite(0, "k0", "k0", "a"), StoreWrite(1, "k0", "k0", "b"))
    )
    fires("INV-28", replace(healthy(), l3=model), r"written by ranks \[0, 1\]")


def test_inv28_a_clear_that_wipes_another_namespace_is_caught() -> None:
    # sglang#32693: clear() wiped a shared directory
    model = replace(healthy().l3, clears=(ClearRecord(0, (("k0_tp0", 0), ("k0_tp1", 1))),))
    fires("INV-28", replace(healthy(), l3=model), "removed 1 pages of other ranks")


# -- INV-29 ---------------------------------------------------------------------------------------
def test_inv29_a_hit_above_a_ranks_run_is_caught() -> None:
    # sglang#39147: a per-pool minimum that is no legal endpoint
    bad = with_prefetch(
        with_prefetch(healthy(), 0, published_hit_tokens=12), 1, published_hit_tokens=12
    )
    fires("INV-29", bad, "MIN over ranks")


def test_inv29_a_hit_shortened_on_the_way_is_caught() -> None:
    # sglang#40193: a full L3 hit silently shortened to free L2 space
    fires("INV-29", with_prefetch(healthy(), 0, bounce_tokens=4), "a 4-token bounce buffer")


# -- INV-30 ---------------------------------------------------------------------------------------
def test_inv30_a_page_read_back_with_other_bytes_is_caught() -> None:
    model = replace(healthy().l3, reads=(StoreRead(1, "k1", "d0k1"),))
    fires("INV-30", replace(healthy(), l3=model), "read key k1 back as d0k1")


def test_inv30_a_page_nobody_wrote_is_caught() -> None:
    model = replace(healthy().l3, reads=(StoreRead(0, "k7", "x"),))
    fires("INV-30", replace(healthy(), l3=model), "no page was written under it")


# -- INV-31 ---------------------------------------------------------------------------------------
def test_inv31_a_page_without_its_predecessor_is_caught() -> None:
    # sglang#26886: write-back persisted evicted leaves, never the prefix head
    model = replace(healthy().l3, present=((0, "k1"), (1, "k0"), (1, "k1")))
    fires("INV-31", replace(healthy(), l3=model), "rank 0: L3 holds page 1")


def test_inv31_a_page_a_fault_lost_is_no_hole() -> None:
    model = replace(healthy().l3, present=((0, "k1"),), lost=((0, "k0"),))
    STORAGE_CHECKS["INV-31"](replace(healthy(), l3=model))


def test_inv29_a_bounce_shorter_than_the_hit_without_a_cut_is_caught() -> None:
    # allocate_storage_hit reported the whole hit for a partial bounce: the tree cut nothing
    bad = with_prefetch(healthy(), 0, bounce_tokens=4, published_progress=(4,), landed_pages=(1,))
    fires("INV-29", bad, "a 4-token bounce buffer")


def test_inv29_a_cut_for_host_room_is_served_whole_and_alike_on_every_rank() -> None:
    # host pressure: the tree served 4 of the 8-token hit on both ranks, keys and buffer alike
    cut = {"cut_tokens": 4, "hash_pages": 1, "bounce_tokens": 4}
    good = with_prefetch(with_prefetch(healthy(), 0, **cut), 1, **cut)
    CheckRunner().run_all(["INV-29"], good)
    fires("INV-29", with_prefetch(good, 1, cut_tokens=6, hash_pages=1), r"cuts \[4, 6\]")
    fires("INV-29", with_prefetch(good, 0, hash_pages=2), "2 page keys")


# -- INV-37 ---------------------------------------------------------------------------------------
def test_inv37_progress_counting_a_page_whose_sidecar_was_not_read_is_caught() -> None:
    # _page_transfer_kv_batch without its min: the KV pages counted, the draft page's read failed
    bad = with_prefetch(healthy(), 0, sidecar_pages=(1, 1))
    fires("INV-37", bad, r"counts 2 page\(s\) but only 1 hold the draft sidecar's bytes")
    CheckRunner().run_all(["INV-37"], with_prefetch(healthy(), 0, sidecar_pages=(1, 2)))


def test_inv37_is_silent_outside_a_sidecar_world() -> None:
    # no draft pool: no sidecar record, nothing to compare
    CheckRunner().run_all(["INV-37"], healthy())
