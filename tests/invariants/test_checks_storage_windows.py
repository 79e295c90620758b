"""The window checks fire on a bad state and stay quiet on a healthy one (INV-32 .. INV-35).

The healthy state is ``test_checks_storage.healthy()``: a two-rank world after one prefetch of
two pages (progress 4, then 8) and one backup of two pages per rank, with the windows the harness
recorded while it ran. Every test breaks one window the way a real bug does and names the bug.
"""

from __future__ import annotations

from dataclasses import replace

from hicache_ref.invariants.checks_storage import STORAGE_IDS
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.storage_snapshot import (
    AckedPageRead,
    LateRead,
    ReadHole,
    StaleGrant,
    StorageSnapshot,
    WindowEvidence,
)

from .test_checks_storage import fires, healthy


def with_windows(**windows: object) -> StorageSnapshot:
    base = healthy()
    return replace(base, windows=replace(base.windows, **windows))  # type: ignore[arg-type]


def acked(digest: str | None, lost: bool = False) -> AckedPageRead:
    return AckedPageRead(0, 7, "k1", digest, "d0k1", lost)


def test_healthy_windows_pass_every_storage_check() -> None:
    good = with_windows(
        acked_reads=(AckedPageRead(0, 7, "k0", "d0k0", "d0k0", False), acked("d0k1")),
        late_reads=(LateRead(0, "r", ("k1",), in_flight=True),),  # parked at it at termination
        holes=(ReadHole(1, "r", 2),),  # a hole past what was counted
        stale_grants=(StaleGrant(0, "io-r0-e2", 2, 2, "batch_get 1 key(s)"),),
    )
    CheckRunner().run_all(STORAGE_IDS, good)
    assert isinstance(good.windows, WindowEvidence)


# -- INV-32 ---------------------------------------------------------------------------------------
def test_inv32_an_ack_put_before_its_write_is_caught() -> None:
    # sglang#39701's class: the tree drained the ack while the write had not run yet
    fires("INV-32", with_windows(acked_reads=(acked(None),)), "L3 returned nothing")


def test_inv32_an_acked_page_with_other_bytes_is_caught() -> None:
    # the host pages were freed and rewritten between the ack and the write it vouched for
    fires("INV-32", with_windows(acked_reads=(acked("other"),)), "bytes other")


def test_inv32_a_page_a_fault_dropped_is_no_violation() -> None:
    CheckRunner().run_all(STORAGE_IDS, with_windows(acked_reads=(acked(None, lost=True),)))


# -- INV-33 ---------------------------------------------------------------------------------------
def test_inv33_reads_that_go_on_after_termination_are_caught() -> None:
    # sglang#16747 / #31296: the IO loop does not look at termination between batches
    late = (LateRead(0, "r", ("k1",), in_flight=True), LateRead(0, "r", ("k2",)))
    fires("INV-33", with_windows(late_reads=late), "2 backend read.s. ran after terminate")


def test_inv33_a_read_not_in_flight_at_the_termination_is_caught() -> None:
    late = (LateRead(0, "r", ("k1",)),)  # the IO was not parked at this read's call
    fires("INV-33", with_windows(late_reads=late), "0 was already in flight")


# -- INV-34 ---------------------------------------------------------------------------------------
def test_inv34_progress_counted_past_a_hole_is_caught() -> None:
    # LMCache #2966's class: a `continue` past the first missing page counts the pages after it
    fires("INV-34", with_windows(holes=(ReadHole(0, "r", 1),)), "counts past page 1")


# -- INV-35 ---------------------------------------------------------------------------------------
def test_inv35_an_old_epoch_thread_granted_after_reset_is_caught() -> None:
    # sglang#36882: a reset left the old IO thread parked inside its loop body
    stale = (StaleGrant(0, "io-r0-e1", 1, 2, "batch_get 1 key(s)"),)
    fires("INV-35", with_windows(stale_grants=stale), "of epoch 1 ran again in epoch 2")
