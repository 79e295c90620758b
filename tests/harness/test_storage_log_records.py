"""The storage log keeps each prefetch's and backup's frozen record until the log changes.

A storage check freezes every log of the case after every storage step; most logs did not
change since the last check, so ``freeze`` hands back the record it built then. These tests pin
what makes that sound: every field a record copies holds an immutable value (so it changes only
by assignment, which drops the kept record), and the two fields read from ``owned_slots`` (a
dict changed in place) are recomputed at every freeze.
"""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest

from hicache_ref.harness.driver.storage_log import BackupLog, PrefetchLog
from hicache_ref.invariants.storage_snapshot import (
    BackupRecord,
    BouncePageEvent,
    PrefetchRecord,
    VerdictRecord,
)

MUTABLE = (list, dict, set, bytearray)


def _prefetch() -> PrefetchLog:
    return PrefetchLog("r1", epoch=0, tokens=8, anchor_prefix=(), chain_uid=1)


@pytest.mark.parametrize(
    ("log", "record"), [(PrefetchLog, PrefetchRecord), (BackupLog, BackupRecord)]
)
def test_every_field_a_record_copies_is_immutable(log: type, record: type) -> None:
    hints = typing.get_type_hints(log)
    for name in log.record_fields:
        hint = hints[name]
        origins = {typing.get_origin(hint) or hint, *map(typing.get_origin, typing.get_args(hint))}
        # Verify no copied field can change in place (a kept record would go stale)
        assert not origins & set(MUTABLE), f"{log.__name__}.{name}: {hint} changes in place"
    # Verify every field of the record but the derived ones is copied from a log field
    derived = {"settled", "unreturned"} if record is PrefetchRecord else set()
    assert {f.name for f in fields(record)} - derived == set(log.record_fields)


def test_an_unchanged_prefetch_log_hands_back_the_same_record() -> None:
    log = _prefetch()
    first = log.freeze()
    # freeze twice, nothing changed -> the same record
    assert log.freeze() is first
    # the snapshot writes completed_now at every check; the same value keeps the record
    log.completed_now = None
    assert log.freeze() is first


def test_a_changed_prefetch_log_freezes_a_new_record() -> None:
    log = _prefetch()
    log.freeze()
    # an applied progress value (a tuple grown by assignment) -> a record that shows it
    log.published_progress += (4,)
    log.landed_pages += (1,)
    assert log.freeze().published_progress == (4,)
    assert log.freeze().landed_pages == (1,)
    log.events += (BouncePageEvent("r1", 0, "insert", 4, False),)
    log.verdicts += (VerdictRecord("r1", True, True, 4, 8),)
    log.completed_now = 8
    record = log.freeze()
    assert record.events[-1].page == 0
    assert record.verdicts[-1].claimed_complete
    assert record.completed_now == 8
    # every field but the derived ones, read back from the record
    assert record == PrefetchRecord(
        **{name: getattr(log, name) for name in PrefetchLog.record_fields},
        settled=True,
        unreturned=(),
    )


def test_owned_slots_changed_in_place_show_in_the_next_record() -> None:
    log = _prefetch()
    log.bounce_tokens = 8
    log.owned_slots[40] = 2
    assert log.freeze().unreturned == (2,)
    assert not log.freeze().settled
    # the tree gives the slot back (a dict changed in place, no assignment)
    del log.owned_slots[40]
    log.retired, log.final_acks = True, 1
    record = log.freeze()
    assert record.unreturned == ()
    assert record.settled


def test_a_backup_log_keeps_its_record_until_an_ack() -> None:
    log = BackupLog(op_id=3, epoch=0, chain_uid=1, pages=2, skipped=False)
    first = log.freeze()
    assert log.freeze() is first
    log.acks += 1
    log.acked_tokens = 8
    record = log.freeze()
    assert record is not first
    assert (record.acks, record.acked_tokens) == (1, 8)
