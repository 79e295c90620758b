"""SimDevice reproduces the CUDA stream/event semantics the controller relies on."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError


def _copy(device: SimDevice, dst: torch.Tensor, src: torch.Tensor, label: str = "copy") -> None:
    device.launch(lambda: dst.copy_(src), label=label)


def test_nothing_moves_until_the_stream_is_advanced() -> None:
    device = SimDevice()
    src, dst = torch.ones(4), torch.zeros(4)
    _copy(device, dst, src)
    # launch -> no bytes yet
    assert torch.equal(dst, torch.zeros(4))
    assert device.advance(device.default_stream, 1) == 1
    assert torch.equal(dst, src)


def test_query_on_a_never_recorded_event_is_true() -> None:
    device = SimDevice()
    assert device.Event().query()


def test_recorded_event_completes_only_when_its_record_executes() -> None:
    device = SimDevice()
    event = device.Event()
    _copy(device, torch.zeros(1), torch.ones(1))
    event.record()
    assert not event.query()
    device.advance(device.default_stream, 1)
    assert not event.query()  # the copy ran, the record has not
    device.advance(device.default_stream, 1)
    assert event.query()


def test_wait_blocks_the_other_stream_until_the_record_runs() -> None:
    device = SimDevice()
    side = device.Stream()
    event = device.Event()
    src, mid, dst = torch.ones(2), torch.zeros(2), torch.zeros(2)
    _copy(device, mid, src)  # producer on the default stream
    event.record()
    with device.stream(side):
        event.wait()
        _copy(device, dst, mid)  # consumer on the side stream
    # side stream: the wait is not satisfiable yet
    assert device.advance(side, 5) == 0
    device.advance(device.default_stream, 2)
    assert device.advance(side, 5) == 2
    assert torch.equal(dst, src)


def test_without_the_wait_the_consumer_reads_stale_bytes() -> None:
    device = SimDevice()
    side = device.Stream()
    src, mid, dst = torch.ones(2), torch.zeros(2), torch.zeros(2)
    _copy(device, mid, src)
    with device.stream(side):
        _copy(device, dst, mid)  # no wait: may run first
    device.advance(side, 1)
    device.advance(device.default_stream, 1)
    assert torch.equal(dst, torch.zeros(2))  # the race is visible as wrong bytes


def test_wait_binds_to_the_most_recent_record_at_wait_time() -> None:
    device = SimDevice()
    side, other = device.Stream(), device.Stream()
    event = device.Event()
    event.record()  # record #1 on default
    with device.stream(side):
        event.wait()  # bound to record #1
    with device.stream(other):
        _copy(device, torch.zeros(1), torch.ones(1))
        event.record()  # record #2 on `other`, after the wait was issued
    device.advance(device.default_stream, 1)  # record #1 done
    # side's wait is satisfied by record #1 even though record #2 is pending
    assert device.advance(side, 1) == 1
    assert not event.query()  # query reflects the latest record (#2)
    device.advance(other, 2)
    assert event.query()


def test_wait_on_a_never_recorded_event_is_a_no_op() -> None:
    device = SimDevice()
    side = device.Stream()
    side.wait_event(device.Event())
    assert side.pending == 0


def test_event_synchronize_runs_only_what_the_record_depends_on() -> None:
    device = SimDevice()
    side = device.Stream()
    event = device.Event()
    _copy(device, torch.zeros(1), torch.ones(1), "a")
    event.record()
    with device.stream(side):
        _copy(device, torch.zeros(1), torch.ones(1), "unrelated")
    event.synchronize()
    assert event.query()
    assert side.pending == 1  # unrelated work on another stream stays queued


def test_stream_synchronize_follows_cross_stream_waits() -> None:
    device = SimDevice()
    side = device.Stream()
    event = device.Event()
    _copy(device, torch.zeros(1), torch.ones(1))
    event.record()
    with device.stream(side):
        event.wait()
        _copy(device, torch.zeros(1), torch.ones(1))
    side.synchronize()
    assert side.query() and device.default_stream.query()


def test_wait_stream_orders_after_everything_queued_so_far() -> None:
    device = SimDevice()
    side = device.Stream()
    mid, dst = torch.zeros(1), torch.zeros(1)
    _copy(device, mid, torch.ones(1))
    side.wait_stream(device.default_stream)
    with device.stream(side):
        _copy(device, dst, mid)
    assert device.advance(side, 3) == 0
    device.run_until_idle()
    assert torch.equal(dst, torch.ones(1))


def test_run_until_idle_is_deterministic_for_a_seed() -> None:
    def trace(seed: int) -> list[str]:
        device = SimDevice(seed=seed)
        streams = [device.Stream() for _ in range(3)]
        for i, stream in enumerate(streams):
            with device.stream(stream):
                for j in range(4):
                    device.launch(lambda: None, label=f"s{i}op{j}")
        device.run_until_idle()
        return [entry.label for entry in device.log]

    assert trace(7) == trace(7)
    assert any(trace(seed) != trace(7) for seed in range(8))


def test_happens_before_log_names_the_record_each_wait_was_bound_to() -> None:
    device = SimDevice()
    side = device.Stream()
    event = device.Event()
    event.record()
    with device.stream(side):
        event.wait()
    device.run_until_idle()
    record = next(e for e in device.log if e.kind == "record")
    wait = next(e for e in device.log if e.kind == "wait")
    assert wait.waited_for_seq == record.seq
    assert device.log.index(record) < device.log.index(wait)


def test_launch_meta_reaches_the_log_and_observers() -> None:
    device = SimDevice()
    seen: list[str] = []
    device.on_execute.append(lambda entry: seen.append(str(entry.meta["direction"])))
    device.launch(lambda: None, label="d2h", meta={"direction": "d2h"})
    device.run_until_idle()
    assert seen == ["d2h"] and device.log[0].meta == {"direction": "d2h"}


def test_advance_refuses_a_negative_count_and_foreign_streams() -> None:
    device = SimDevice()
    with pytest.raises(HiCacheInputError, match="n must be >= 0"):
        device.advance(device.default_stream, -1)
    with pytest.raises(HiCacheInputError, match="SimStream"):
        device.advance(object(), 1)  # type: ignore[arg-type]


def test_advance_to_record_stops_right_after_the_streams_next_record() -> None:
    # copy, copy, record(e1), copy, record(e2) -> advance_to_record runs three ops: e1 is
    # visible while the copy behind it is still queued; the next call runs up to e2
    device = SimDevice(seed=0)
    stream = device.Stream("load")
    ran: list[str] = []
    first, second = device.Event(), device.Event()
    with device.stream(stream):
        device.launch(lambda: ran.append("a"), label="a", kind="copy")
        device.launch(lambda: ran.append("b"), label="b", kind="copy")
        first.record()
        device.launch(lambda: ran.append("c"), label="c", kind="copy")
        second.record()
    assert device.advance_to_record(stream) == 3
    assert ran == ["a", "b"] and first.query() and not second.query()
    assert device.advance_to_record(stream) == 2 and second.query()
    assert device.advance_to_record(stream) == 0  # nothing left


def test_advance_to_record_counts_a_record_settled_on_its_own() -> None:
    # with settle_records the record runs as soon as it reaches the head: the copy before it
    # is the last op advance_to_record runs
    device = SimDevice(seed=0, settle_records=True)
    stream = device.Stream("write")
    event = device.Event()
    with device.stream(stream):
        device.launch(lambda: None, label="a", kind="copy")
        event.record()
        device.launch(lambda: None, label="b", kind="copy")
    assert device.advance_to_record(stream) == 1
    assert event.query() and stream.pending == 1


def test_advance_to_record_stops_at_a_blocked_wait() -> None:
    device = SimDevice(seed=0)
    producer, consumer = device.Stream("producer"), device.Stream("consumer")
    event = device.Event()
    with device.stream(producer):
        event.record()
    with device.stream(consumer):
        event.wait()
        consumer_done = device.Event()
        consumer_done.record()
    assert device.advance_to_record(consumer) == 0  # the wait's record has not run
    device.advance(producer, 1)
    assert device.advance_to_record(consumer) == 2 and consumer_done.query()
