"""Transfer checkers: INV-04 (layers before ack), INV-06 (bytes), INV-11, INV-12, INV-15."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_transfer import (
    check_bytes_equal,
    check_layers_submitted,
    check_no_stale_layer_writes,
)


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


# --- INV-15 ------------------------------------------------------------------------------------


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
