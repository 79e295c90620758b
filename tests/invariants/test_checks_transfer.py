"""Transfer checkers: INV-04 (layers before ack), INV-06 (bytes), INV-11, INV-12, INV-15."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_transfer import (
    check_bytes_equal,
    check_cancel_quiesced,
    check_layer_landed_before_read,
    check_layer_write_complete,
    check_layers_submitted,
    check_load_finish_after_copies,
    check_no_stale_layer_writes,
    check_store_before_backup,
)
from hicache_ref.invariants.models import (
    CpHiCacheNodeMetadata,
    HiCacheLayerWriteState,
    HiCacheWriteReservation,
)

from .factories import FakeEvent, metadata_fields, pages_of


def detail(excinfo: pytest.ExceptionInfo[InvariantViolation], inv_id: str) -> str:
    assert excinfo.value.inv_id == inv_id
    return excinfo.value.detail


# --- INV-04 ------------------------------------------------------------------------------------


def test_layers_submitted_passes_with_every_layer() -> None:
    check_layers_submitted(3, {0, 1, 2}, {0, 1, 2, 3}, 3, 4)
    check_layers_submitted(3, {0, 1, 2}, set(), 3, None)


def test_missing_draft_layer_before_the_ack_is_caught() -> None:
    # draft pool has 4 layers, the hook for draft layer 3 never ran before the ack
    with pytest.raises(InvariantViolation) as excinfo:
        check_layers_submitted(3, {0, 1, 2}, {0, 1, 2}, 3, 4)
    assert detail(excinfo, "INV-04") == (
        "write ack for node_id=3 appended while target layers [] and draft layers [3] were not "
        "submitted (append the ack only after the last target and draft layer copy)"
    )


def test_layer_write_complete_reads_the_state() -> None:
    meta = CpHiCacheNodeMetadata(**metadata_fields())  # type: ignore[arg-type]
    res = HiCacheWriteReservation(
        metadata=meta,
        host_indices=meta.host_indices,
        physical_device_indices=pages_of(0, 16),
        node_id=2,
    )
    state = HiCacheLayerWriteState(
        reservation=res, total_layers=2, start_event=FakeEvent(), finish_event=FakeEvent()
    )
    state.completed_target_layers.add(0)
    with pytest.raises(InvariantViolation, match=r"target layers \[1\]"):
        check_layer_write_complete(state, 2, None)
    state.completed_target_layers.add(1)
    check_layer_write_complete(state, 2, None)


def test_load_finish_after_every_copy_passes() -> None:
    check_load_finish_after_copies([4], 10, {"target": {0: 2, 1: 5}, "draft": {0: 1, 1: 4, 2: 9}})


def test_load_finish_before_the_draft_tail_is_caught() -> None:
    # seed start_loading: finish = load_events[layer_num-1] recorded after target layer 1,
    # but draft layer 2 (draft has 3 layers) is copied after it
    with pytest.raises(InvariantViolation) as excinfo:
        check_load_finish_after_copies(
            [4], 6, {"target": {0: 2, 1: 5}, "draft": {0: 1, 1: 4, 2: 7}}
        )
    assert detail(excinfo, "INV-04") == (
        "load ack for node_ids [4] finishes at position 6, before the draft layer 2 copy at "
        "position 7 (record the finish event after the last target and draft copy)"
    )


# --- INV-06 ------------------------------------------------------------------------------------


def test_bytes_equal_passes_on_identical_copies() -> None:
    kv = torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(0))
    check_bytes_equal(kv.clone(), kv, "host page 0")
    check_bytes_equal(torch.empty(0, 3), torch.empty(0, 3), "empty")


def test_bytes_equal_names_the_first_differing_row() -> None:
    expected = torch.zeros(6, 4, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[3, 1] = 1.0
    actual[5] = 2.0
    with pytest.raises(InvariantViolation) as excinfo:
        check_bytes_equal(actual, expected, "device layer 2 of node 7")
    assert detail(excinfo, "INV-06") == (
        "device layer 2 of node 7: row 3 differs from the oracle in 2 of 8 bytes (2 rows "
        "differ; a round trip must return the bytes that were written)"
    )


def test_bytes_equal_compares_bits_not_values() -> None:
    # -0.0 == 0.0 numerically, but a copy that flips the sign bit did not copy the bytes
    with pytest.raises(InvariantViolation, match="row 0 differs"):
        check_bytes_equal(torch.tensor([[-0.0]]), torch.tensor([[0.0]]), "sign")
    nan = torch.tensor([[float("nan")]])
    check_bytes_equal(nan.clone(), nan, "nan")


def test_bytes_equal_reports_a_shape_or_dtype_change() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_bytes_equal(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16), "nsa index")
    assert detail(excinfo, "INV-06") == (
        "nsa index: got torch.float32 (2, 3), expected torch.float16 (2, 3) (a copy preserves "
        "dtype and shape)"
    )


# --- INV-11 / INV-12 ---------------------------------------------------------------------------


def test_read_after_the_layer_landed_passes() -> None:
    check_layer_landed_before_read(2, {0, 1, 2}, consumer_index=1)


def test_read_before_the_layer_landed_is_caught() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_layer_landed_before_read(3, {0, 1, 2}, pool="draft", consumer_index=1)
    assert detail(excinfo, "INV-11") == (
        "forward read draft layer 3 of producer slot 1 before it landed (landed: [0, 1, 2]; "
        "wait_until(3) on the consumer slot first)"
    )


def test_backup_after_the_store_passes_and_before_it_is_caught() -> None:
    check_store_before_backup(5, 1, {0, 1})
    with pytest.raises(InvariantViolation) as excinfo:
        check_store_before_backup(5, 2, {0, 1})
    assert detail(excinfo, "INV-12") == (
        "per-layer D2H of node_id=5 layer 2 started before that layer's KV store (record a "
        "layer event on the forward stream and make the write stream wait on it)"
    )


# --- INV-15 ------------------------------------------------------------------------------------


def test_cancelled_node_untouched_afterwards_passes() -> None:
    check_cancel_quiesced({4}, [5, 6], [[5], [6]])


def test_layer_copy_after_cancel_is_caught() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_cancel_quiesced({4}, [5, 4], [])
    assert detail(excinfo, "INV-15") == (
        "a layer hook copied into node_id=4's host slots after cancel_layer_write_state dropped "
        "it (the state must be gone from pending_layer_writes)"
    )


def test_ack_after_cancel_is_caught() -> None:
    with pytest.raises(
        InvariantViolation,
        match="write ack row 1 appended after the cancel carries cancelled node_id=4",
    ):
        check_cancel_quiesced({4}, [], [[5], [6, 4]])


def test_bytes_equal_reports_under_the_callers_id_with_decoded_rows() -> None:
    # the harness runs the same comparison at an ack drain (INV-09) and decodes who wrote a row
    expected = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    actual = expected.clone()
    actual[2, 0] = -1.0
    with pytest.raises(InvariantViolation) as excinfo:
        check_bytes_equal(
            actual,
            expected,
            "write ack drained",
            inv_id="INV-09",
            describe_row=lambda row: f"value {float(row[0])}",
            fix="copy after the store",
        )
    assert excinfo.value.inv_id == "INV-09"
    assert "row 2 holds value -1.0, expected value 4.0;" in excinfo.value.detail
    assert excinfo.value.detail.endswith("copy after the store)")


def test_a_pending_layer_write_outliving_its_backup_is_caught() -> None:
    check_no_stale_layer_writes({3}, {3, 5}, "rank 0")
    with pytest.raises(InvariantViolation) as excinfo:
        check_no_stale_layer_writes({3, 8}, {3}, "rank 1")
    assert excinfo.value.inv_id == "INV-15"
    assert excinfo.value.detail.startswith(
        "rank 1: per-layer write states still pending for node ids [8]"
    )
