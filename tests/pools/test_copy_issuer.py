"""The native issuing thread of the copy engine, driven on the CPU through its stand-ins.

``copy_issuer.c`` takes its three entry points as function pointers, so the same thread, ring
and ordering words run here with CPU stand-ins: a batch is one ``memmove`` per copy, a write
stores the word, a wait on the side stream spins until the word arrives. What the GPU adds (the
caller's stream waiting on *done*) is exercised by ``test_fast_copy_cuda.py``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from hicache_ref.pools.copy_engine import RowBatches
from hicache_ref.pools.copy_issuer import (
    CopyIssuer,
    CopyIssuerError,
    cpu_stand_ins,
    load_issuer_library,
)

CALLER_STREAM = 1  # any non-zero handle: the stand-in's caller-side wait returns at once


def cpu_issuer(*, failing: bool = False, memops: bool = True) -> tuple[CopyIssuer, torch.Tensor]:
    library, why = load_issuer_library()
    assert library is not None, why
    stand_ins = cpu_stand_ins(library)
    flags = torch.zeros(2, dtype=torch.int64)
    issuer = CopyIssuer.create(
        library,
        batch=stand_ins.fail if failing else stand_ins.batch,
        runtime13=True,
        wait=stand_ins.wait,
        write=stand_ins.write,
        side_stream=0,
        flags=flags,
        memops=stand_ins.memops if memops else 0,
    )
    return issuer, flags


def page_rows(
    source: torch.Tensor, target: torch.Tensor, pairs: list[list[tuple[int, int]]]
) -> RowBatches:
    """A ``RowBatches`` copying 4-byte word ``s`` of ``source`` to word ``d`` of ``target`` for
    each ``(s, d)`` of each row."""
    dsts = torch.tensor([[target.data_ptr() + 4 * d for _, d in row] for row in pairs])
    srcs = torch.tensor([[source.data_ptr() + 4 * s for s, _ in row] for row in pairs])
    sizes = torch.full((len(pairs[0]),), 4, dtype=torch.int64)
    return RowBatches(dsts, srcs, sizes, d2h=False, device_index=0)


@pytest.mark.parametrize("memops", [True, False], ids=["one-batched-call", "two-calls"])
def test_the_thread_issues_every_row_in_order_and_counts_them(memops: bool) -> None:
    # the caller's write and wait go through cuStreamBatchMemOp's layout, or one call each
    issuer, flags = cpu_issuer(memops=memops)
    source = torch.arange(100, dtype=torch.int32)
    target = torch.full((100,), -1, dtype=torch.int32)
    # row 1 overwrites word 5 that row 0 wrote: the later row must win
    rows = page_rows(source, target, [[(10, 5), (11, 6)], [(12, 5), (13, 7)]])
    for _ in range(3):
        issuer.issue(
            CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, rows.count, 0,
            keep=rows, repeat=rows.rows, stride=rows.count * 8,
        )  # fmt: skip
    issuer.drain()
    assert target[5:8].tolist() == [12, 11, 13]
    assert target[:5].eq(-1).all() and target[8:].eq(-1).all()
    assert flags.tolist() == [3, 3]  # ready and done reached the third sequence number
    issuer.close()


def test_a_failed_batch_releases_the_stream_and_is_raised_at_the_next_issue() -> None:
    issuer, flags = cpu_issuer(failing=True)
    source = torch.arange(8, dtype=torch.int32)
    target = torch.zeros(8, dtype=torch.int32)
    rows = page_rows(source, target, [[(1, 2)]])
    args = (CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, rows.count, 0)
    issuer.issue(*args, keep=rows)
    with pytest.raises(CopyIssuerError, match="cudaMemcpyBatchAsync failed with CUDA error 1"):
        issuer.drain()
    assert flags[1].item() == 1  # done was written: a GPU stream waiting on it would go on
    with pytest.raises(CopyIssuerError, match="cudaMemcpyBatchAsync failed"):
        issuer.issue(*args, keep=rows)
    assert target.eq(0).all()
    issuer.close()


def test_the_arrays_of_a_pending_batch_stay_alive_until_it_is_issued() -> None:
    issuer, _ = cpu_issuer()
    source = torch.arange(16, dtype=torch.int32)
    target = torch.zeros(16, dtype=torch.int32)
    for word in range(12):
        rows = page_rows(source, target, [[(word, word)]])
        issuer.issue(CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, 1, 0, keep=rows)
        del rows  # only the issuer holds it now
    issuer.drain()
    assert target[:12].tolist() == list(range(12))
    issuer.close()


def test_the_stand_ins_are_plain_c_functions() -> None:
    library, _ = load_issuer_library()
    assert library is not None
    stand_ins = cpu_stand_ins(library)
    word = (ctypes.c_uint64 * 1)(0)
    write = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                             ctypes.c_uint)(stand_ins.write)  # fmt: skip
    assert write(None, ctypes.addressof(word), 42, 0) == 0 and word[0] == 42


def test_a_stepped_entry_releases_each_batch_as_soon_as_it_is_issued() -> None:
    # Each batch copies the done word itself into its own slot of the target: what done held
    # when the thread issued that batch. Stepped, batch k sees batch k-1's value; the caller
    # then waits batch by batch, and a later plain issue goes on from the last value.
    issuer, flags = cpu_issuer()
    done_address = flags.data_ptr() + 8
    target = torch.full((4,), -1, dtype=torch.int64)
    dsts = torch.tensor([[target.data_ptr() + 8 * k] for k in range(4)])
    srcs = torch.tensor([[done_address] for _ in range(4)])
    sizes = torch.full((1,), 8, dtype=torch.int64)
    rows = RowBatches(dsts, srcs, sizes, d2h=False, device_index=0)
    first = issuer.issue_stepped(
        CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, 1, 0,
        keep=rows, repeat=4, stride=8,
    )  # fmt: skip
    for k in range(4):
        issuer.wait_done(CALLER_STREAM, first + k)
    issuer.drain()
    assert first == 1
    assert target.tolist() == [0, 1, 2, 3]  # batch k issued once done reached first + k - 1
    assert flags.tolist() == [1, 4]  # one ready write; done reached the last batch
    issuer.issue(CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, 1, 0, keep=rows)
    issuer.drain()
    assert flags.tolist() == [5, 5]
    issuer.close()


def test_a_plain_entry_of_several_batches_writes_done_once_after_the_last() -> None:
    issuer, flags = cpu_issuer()
    target = torch.full((3,), -1, dtype=torch.int64)
    dsts = torch.tensor([[target.data_ptr() + 8 * k] for k in range(3)])
    srcs = torch.tensor([[flags.data_ptr() + 8] for _ in range(3)])
    rows = RowBatches(dsts, srcs, torch.full((1,), 8, dtype=torch.int64), d2h=False,
                      device_index=0)  # fmt: skip
    issuer.issue(CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, 1, 0,
                 keep=rows, repeat=3, stride=8)  # fmt: skip
    issuer.drain()
    assert target.tolist() == [0, 0, 0] and flags.tolist() == [1, 1]
    issuer.close()


SOURCE = torch.arange(16, dtype=torch.int32)
TARGET = torch.zeros(16, dtype=torch.int32)
"""The words a stepped test load copies (alive for the process: the thread writes them)."""


def stepped_rows(issuer: CopyIssuer, layers: int) -> tuple[int, RowBatches]:
    """A stepped entry of ``layers`` one-word batches (each copies word k to word k)."""
    rows = page_rows(SOURCE, TARGET, [[(k, k)] for k in range(layers)])
    first = issuer.issue_stepped(
        CALLER_STREAM, rows.dsts_ptr, rows.srcs_ptr, rows.sizes_ptr, 1, 0,
        keep=rows, repeat=layers, stride=8,
    )  # fmt: skip
    return first, rows


def test_one_native_call_waits_for_each_layer_then_records_that_layers_events() -> None:
    # A load of 3 layers, two events after layer 0 and 1 (its own and the next draft layer's),
    # one after layer 2. The stand-in record stores the value the caller's stream last waited
    # for: each event must hold the batch it follows, and a NULL slot records nothing.
    issuer, flags = cpu_issuer()
    library, _ = load_issuer_library()
    assert library is not None
    stand_ins = cpu_stand_ins(library)
    first, _rows = stepped_rows(issuer, 3)
    words = (ctypes.c_uint64 * 5)(*([0] * 5))
    base = ctypes.addressof(words)
    handles = [base, base + 8, base + 16, base + 24, base + 32, None]
    array = (ctypes.c_void_p * 6)(*handles)
    issuer.wait_record(CALLER_STREAM, first, 3, ctypes.addressof(array), 2, stand_ins.record)
    issuer.drain()
    assert list(words) == [first, first, first + 1, first + 1, first + 2]
    assert flags.tolist() == [first, first + 2]
    issuer.close()


def test_a_failed_record_still_queues_the_last_wait_and_is_raised_in_one_line() -> None:
    issuer, _ = cpu_issuer()
    library, _ = load_issuer_library()
    assert library is not None
    stand_ins = cpu_stand_ins(library)
    first, _rows = stepped_rows(issuer, 3)
    word = (ctypes.c_uint64 * 1)(0)
    array = (ctypes.c_void_p * 3)(ctypes.addressof(word), None, None)
    with pytest.raises(CopyIssuerError, match="caller ops failed with CUDA error 400"):
        issuer.wait_record(
            CALLER_STREAM, first, 3, ctypes.addressof(array), 1, stand_ins.record_fail
        )
    # the record after batch 0 failed, and the last batch's wait was still queued: no later
    # work on the caller's stream passes the copies
    last_wait = library.hc_cpu_last_caller_wait
    last_wait.restype = ctypes.c_uint64
    assert last_wait() == first + 2
    with pytest.raises(CopyIssuerError, match="caller ops failed with CUDA error 400"):
        issuer.check()  # remembered for the issuer's next call
    issuer.close()
