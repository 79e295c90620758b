"""The validated records: each rule fires on a record that breaks it, with its message pinned,
and good records (every rank, zero-owned ranks, drafts, device tensors) are accepted."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants.models import (
    CpHiCacheNodeMetadata,
    HiCacheLayerWriteState,
    HiCacheWriteFailure,
    HiCacheWriteReservation,
    HiCacheWriteResult,
)

from .factories import PAGE, FakeEvent, metadata_fields, pages_of


def build_metadata(**overrides: object) -> CpHiCacheNodeMetadata:
    fields = metadata_fields()
    fields.update(overrides)
    return CpHiCacheNodeMetadata(**fields)  # type: ignore[arg-type]


def validation_message(excinfo: pytest.ExceptionInfo[ValidationError]) -> str:
    """The one error's message, without pydantic's 'Value error, ' prefix."""
    errors = excinfo.value.errors()
    assert len(errors) == 1
    return str(errors[0]["msg"]).removeprefix("Value error, ")


# --- CpHiCacheNodeMetadata: good records ------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("pages", [1, 3, 8])
def test_metadata_accepts_every_rank_of_a_round_robin_layout(cp_size: int, pages: int) -> None:
    # every rank's record of the same node is valid, zero-owned ranks included (INV-13)
    for rank in range(cp_size):
        meta = CpHiCacheNodeMetadata(**metadata_fields(pages=pages, cp_size=cp_size, rank=rank))  # type: ignore[arg-type]
        assert meta.num_pages == pages
        assert meta.owned_positions.numel() == meta.host_indices.numel()


def test_metadata_valid_len_is_the_logical_len() -> None:
    meta = build_metadata(logical_len=17)
    assert (meta.valid_len, meta.padded_len) == (17, 2 * PAGE)


def test_metadata_accepts_an_exactly_page_sized_node_and_an_empty_one() -> None:
    assert build_metadata(logical_len=2 * PAGE).padded_len == 2 * PAGE
    empty = CpHiCacheNodeMetadata(**metadata_fields(pages=0, logical_len=0))  # type: ignore[arg-type]
    assert empty.num_pages == 0


def test_metadata_accepts_a_zero_owned_rank_with_an_empty_draft() -> None:
    # rank 1 of 2 owns nothing of a one-page node; it still records the owner pattern
    meta = CpHiCacheNodeMetadata(
        **metadata_fields(pages=1, cp_size=2, rank=1, with_draft=True)  # type: ignore[arg-type]
    )
    assert meta.owned_positions.numel() == 0
    assert meta.draft_host_indices is not None and meta.draft_host_indices.numel() == 0


def test_metadata_accepts_host_pages_in_any_order() -> None:
    # host pages need not be sorted or adjacent, only whole aligned pages
    assert build_metadata(host_indices=pages_of(5 * PAGE, 2 * PAGE)).host_indices.numel() == 32


def test_metadata_accepts_the_seed_keyword_construction() -> None:
    # reserve_write_cp in the seed passes exactly these keywords (seed lines 1145-1155)
    fields = metadata_fields(with_draft=True)
    meta = CpHiCacheNodeMetadata(
        logical_len=fields["logical_len"],  # type: ignore[arg-type]
        padded_len=fields["padded_len"],  # type: ignore[arg-type]
        owned_positions=fields["owned_positions"],  # type: ignore[arg-type]
        host_indices=fields["host_indices"],  # type: ignore[arg-type]
        page_owners=fields["page_owners"],  # type: ignore[arg-type]
        page_size=fields["page_size"],  # type: ignore[arg-type]
        draft_host_indices=fields["draft_host_indices"],  # type: ignore[arg-type]
    )
    assert meta.draft_host_indices is not None


# --- CpHiCacheNodeMetadata: each rule firing ---------------------------------------------------

BAD_METADATA = [
    pytest.param(
        {"page_size": 0},
        "INV-13: page_size=0 must be positive",
        id="page_size-zero",
    ),
    pytest.param(
        {"logical_len": -1},
        "INV-13: logical_len=-1 must be >= 0",
        id="logical_len-negative",
    ),
    pytest.param(
        {"logical_len": 20, "padded_len": 20},
        "INV-13: padded_len=20 is not a multiple of page_size=16 (expected 32 for logical_len=20)",
        id="padded_len-not-page-multiple",
    ),
    pytest.param(
        {"logical_len": 40},
        "INV-13: padded_len=32 is shorter than logical_len=40 (padding only adds a tail; "
        "expected 48)",
        id="padded_len-shorter-than-logical",
    ),
    pytest.param(
        {"logical_len": 16},
        "INV-13: padded_len=32 pads logical_len=16 by a whole page or more (page_size=16; "
        "expected 16)",
        id="padded_len-a-page-too-long",
    ),
    pytest.param(
        {"logical_len": 0},
        "INV-13: padded_len=32 pads logical_len=0 by a whole page or more (page_size=16; "
        "expected 0)",
        id="empty-node-with-pages",
    ),
    pytest.param(
        {"page_owners": torch.tensor([0, 0], dtype=torch.int64)},
        "INV-13: page_owners must be a 1-D torch.int8 tensor, got 1-D torch.int64",
        id="page_owners-dtype",
    ),
    pytest.param(
        {"page_owners": torch.tensor([0, 0, 0], dtype=torch.int8)},
        "INV-13: len(page_owners)=3 but padded_len // page_size=2 (they must match)",
        id="page_owners-one-per-page",
    ),
    pytest.param(
        {"owned_positions": torch.arange(32, dtype=torch.int32)},
        "INV-13: owned_positions must be a 1-D torch.int64 tensor, got 1-D torch.int32",
        id="owned_positions-dtype",
    ),
    pytest.param(
        {"host_indices": pages_of(1024)},
        "INV-13: len(host_indices)=16 but len(owned_positions)=32 (they must match)",
        id="host_indices-count",
    ),
    pytest.param(
        {"host_indices": pages_of(1024, 1040).reshape(2, 16)},
        "INV-13: host_indices must be a 1-D torch.int64 tensor, got 2-D torch.int64",
        id="host_indices-2d",
    ),
    pytest.param(
        {"draft_host_indices": pages_of(2048)},
        "INV-13: len(draft_host_indices)=16 but len(host_indices)=32 (they must match)",
        id="draft_host_indices-count",
    ),
    pytest.param(
        {"owned_positions": torch.arange(12), "host_indices": torch.arange(1024, 1036)},
        "INV-13: len(owned_positions)=12 must be whole pages of page_size=16 and at most "
        "padded_len=32 (ranks own whole pages)",
        id="owned_positions-partial-page",
    ),
    pytest.param(
        {"owned_positions": pages_of(16, 0)},
        "INV-13: owned_positions is not sorted: position 16 holds 0 after 31 "
        "(expected strictly increasing positions)",
        id="owned_positions-unsorted",
    ),
    pytest.param(
        {
            "owned_positions": torch.cat(
                [torch.arange(15), torch.tensor([14]), torch.arange(16, 32)]
            )
        },
        "INV-13: owned_positions has a duplicate: position 15 holds 14 after 14 "
        "(expected strictly increasing positions)",
        id="owned_positions-duplicate",
    ),
    pytest.param(
        {"owned_positions": pages_of(16, 32)},
        "INV-13: owned_positions holds 47, outside [0, padded_len=32)",
        id="owned_positions-past-padded_len",
    ),
    pytest.param(
        {"owned_positions": torch.arange(-16, 16)},
        "INV-13: owned_positions holds -16, outside [0, padded_len=32)",
        id="owned_positions-negative",
    ),
    pytest.param(
        {
            "padded_len": 48,
            "logical_len": 40,
            "page_owners": torch.zeros(3, dtype=torch.int8),
            "owned_positions": torch.arange(8, 40),
        },
        "INV-13: owned_positions page 0 (positions 0..15) starts at 8, not a multiple of "
        "page_size=16 (expected 0 or 16) (a rank owns whole logical pages)",
        id="owned_positions-straddle-pages",
    ),
    pytest.param(
        {"host_indices": torch.arange(1025, 1057)},
        "INV-01: metadata.host_indices page 0 (positions 0..15) starts at 1025, not a "
        "multiple of page_size=16 (expected 1024 or 1040)",
        id="host_indices-misaligned",
    ),
    pytest.param(
        {"host_indices": torch.cat([pages_of(1024), torch.arange(2048, 2056), pages_of(0)[:8]])},
        "INV-01: metadata.host_indices page 1 (positions 16..31) is not one contiguous run: "
        "position 24 holds 0, expected 2056",
        id="host_indices-page-not-contiguous",
    ),
    pytest.param(
        {"host_indices": pages_of(-16, 0)},
        "INV-01: metadata.host_indices page 0 (positions 0..15) starts at -16: a negative "
        "index is silently skipped by the transfer kernel (use a real slot)",
        id="host_indices-negative",
    ),
    pytest.param(
        {"draft_host_indices": torch.arange(3, 35)},
        "INV-01: metadata.draft_host_indices page 0 (positions 0..15) starts at 3, not a "
        "multiple of page_size=16 (expected 0 or 16)",
        id="draft_host_indices-misaligned",
    ),
    pytest.param(
        {"page_owners": torch.tensor([0, -1], dtype=torch.int8)},
        "INV-13: page_owners[1]=-1 is not a CP rank (must be >= 0)",
        id="page_owners-negative",
    ),
    pytest.param(
        {"page_owners": torch.tensor([0, 1], dtype=torch.int8)},
        "INV-13: owned pages [0, 1] are not the pages whose owner is rank 0 ([0]) in "
        "page_owners (owner replay would misplace bytes)",
        id="owned-pages-span-two-owners",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_METADATA)
def test_metadata_rejects_a_record_breaking_one_rule(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        build_metadata(**overrides)
    assert validation_message(excinfo) == message


def test_metadata_rejects_unknown_fields_and_is_frozen() -> None:
    with pytest.raises(ValidationError, match=r"extra_forbidden|Extra inputs"):
        build_metadata(valid_len=3)
    meta = build_metadata()
    with pytest.raises(ValidationError, match="frozen"):
        meta.padded_len = 48  # type: ignore[misc]


def test_metadata_rejects_a_bool_or_float_length() -> None:
    # strict ints: a bool or float length is a caller bug, not something to coerce
    with pytest.raises(ValidationError):
        build_metadata(logical_len=29.0)
    with pytest.raises(ValidationError):
        build_metadata(page_size=True)


# --- CpHiCacheNodeMetadata: device tensors are checked without reading values ------------------


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """A stand-in for a CUDA tensor: same shape and dtype, not on the CPU, values unreadable.

    Any value read (``item``, ``bool``, ``tolist``) of a meta tensor raises, so a validator
    that would synchronize a CUDA stream fails these tests instead of passing silently.
    """
    return torch.empty_like(tensor, device="meta")


def test_device_metadata_is_validated_without_reading_values() -> None:
    # values that break every value rule, on a device: only shapes are checked, so it passes
    fields = metadata_fields(with_draft=True)
    for name in ("owned_positions", "host_indices", "page_owners", "draft_host_indices"):
        fields[name] = on_device(fields[name])  # type: ignore[arg-type]
    meta = CpHiCacheNodeMetadata(**fields)  # type: ignore[arg-type]
    assert meta.host_indices.device.type == "meta"


def test_device_metadata_still_fails_shape_rules() -> None:
    with pytest.raises(ValidationError) as excinfo:
        build_metadata(host_indices=on_device(pages_of(1024)))
    assert validation_message(excinfo) == (
        "INV-13: len(host_indices)=16 but len(owned_positions)=32 (they must match)"
    )


def test_cpu_tensors_are_value_checked_next_to_device_ones() -> None:
    # host indices on the device are skipped, CPU owned_positions are still checked
    with pytest.raises(ValidationError) as excinfo:
        build_metadata(host_indices=on_device(pages_of(0, 16)), owned_positions=pages_of(16, 0))
    assert validation_message(excinfo).startswith("INV-13: owned_positions is not sorted")


# --- HiCacheWriteFailure / HiCacheWriteResult --------------------------------------------------


def test_write_failure_defaults_to_a_host_capacity_shortfall() -> None:
    failure = HiCacheWriteFailure(required_host_slots=32)
    assert (failure.reason, failure.metadata) == ("host_capacity", None)


@pytest.mark.parametrize("reason", ["host_capacity", "undrained_ack", "draft_host_capacity"])
def test_write_failure_accepts_each_known_reason(reason: str) -> None:
    assert HiCacheWriteFailure(required_host_slots=0, reason=reason).reason == reason  # type: ignore[arg-type]


def test_write_failure_rejects_an_unknown_reason_naming_the_legal_ones() -> None:
    with pytest.raises(ValidationError) as excinfo:
        HiCacheWriteFailure(required_host_slots=0, reason="device_capacity")  # type: ignore[arg-type]
    assert validation_message(excinfo) == (
        "Input should be 'host_capacity', 'undrained_ack' or 'draft_host_capacity'"
    )


def test_write_failure_and_result_reject_negative_slot_counts() -> None:
    with pytest.raises(ValidationError) as excinfo:
        HiCacheWriteFailure(required_host_slots=-1)
    assert validation_message(excinfo) == "required_host_slots=-1 must be >= 0"
    with pytest.raises(ValidationError):
        HiCacheWriteResult(metadata=None, required_host_slots=-16)


def test_write_result_carries_the_metadata() -> None:
    meta = build_metadata()
    result = HiCacheWriteResult(metadata=meta)
    assert result.metadata is meta and result.required_host_slots == 0


# --- HiCacheWriteReservation -------------------------------------------------------------------


def build_reservation(*, with_draft: bool = True, **overrides: object) -> HiCacheWriteReservation:
    meta = build_metadata(draft_host_indices=pages_of(4096, 4112) if with_draft else None)
    fields: dict[str, object] = {
        "metadata": meta,
        "host_indices": meta.host_indices,
        "physical_device_indices": pages_of(160, 176),
        "node_id": 7,
        "draft_host_indices": meta.draft_host_indices,
    }
    fields.update(overrides)
    return HiCacheWriteReservation(**fields)  # type: ignore[arg-type]


def test_reservation_defaults_match_the_seed() -> None:
    meta = build_metadata()
    res = HiCacheWriteReservation(
        metadata=meta, host_indices=meta.host_indices, physical_device_indices=pages_of(0, 16)
    )
    assert (res.node_id, res.priority, res.draft_host_indices, res.required_host_slots) == (
        -1,
        None,
        None,
        0,
    )


def test_reservation_accepts_paired_target_and_draft_indices() -> None:
    assert build_reservation().node_id == 7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"physical_device_indices": pages_of(160)},
            "INV-13: len(physical_device_indices)=16 but len(host_indices)=32 (each reserved "
            "host slot pairs with one device slot)",
            id="device-count",
        ),
        pytest.param(
            {"draft_host_indices": pages_of(4096, 4112, 4128)},
            "INV-13: len(draft_host_indices)=48 but len(host_indices)=32 (each reserved host "
            "slot pairs with one device slot)",
            id="draft-count",
        ),
        pytest.param(
            {
                "host_indices": pages_of(1024, 1040, 1056),
                "physical_device_indices": pages_of(0, 16, 32),
                "draft_host_indices": pages_of(4096, 4112, 4128),
            },
            "INV-13: len(metadata.host_indices)=32 but len(host_indices)=48 (each reserved "
            "host slot pairs with one device slot)",
            id="metadata-count",
        ),
        pytest.param(
            {"draft_host_indices": None},
            "INV-13: the reservation and its metadata disagree on having a draft copy "
            "(reservation: False, metadata: True); both or neither",
            id="draft-presence",
        ),
        pytest.param(
            {"physical_device_indices": torch.arange(161, 193)},
            "INV-01: reservation.physical_device_indices page 0 (positions 0..15) starts at "
            "161, not a multiple of page_size=16 (expected 160 or 176)",
            id="device-misaligned",
        ),
        pytest.param(
            {"host_indices": torch.arange(1030, 1062)},
            "INV-01: reservation.host_indices page 0 (positions 0..15) starts at 1030, not a "
            "multiple of page_size=16 (expected 1024 or 1040)",
            id="host-copy-misaligned",
        ),
    ],
)
def test_reservation_rejects_unpaired_or_misaligned_indices(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        build_reservation(**overrides)  # type: ignore[arg-type]
    assert validation_message(excinfo) == message


def test_reservation_skips_value_checks_of_device_indices() -> None:
    # physical device indices live on the GPU in production: lengths only
    res = build_reservation(physical_device_indices=on_device(torch.arange(161, 193)))
    assert res.physical_device_indices.device.type == "meta"


# --- HiCacheLayerWriteState --------------------------------------------------------------------


def build_state(*, with_draft: bool = True, zero_owned: bool = False) -> HiCacheLayerWriteState:
    if zero_owned:
        meta = CpHiCacheNodeMetadata(
            **metadata_fields(pages=1, cp_size=2, rank=1, with_draft=with_draft)  # type: ignore[arg-type]
        )
        empty = torch.empty(0, dtype=torch.int64)
        res = HiCacheWriteReservation(
            metadata=meta,
            host_indices=empty,
            physical_device_indices=empty,
            node_id=3,
            draft_host_indices=empty.clone() if with_draft else None,
        )
        return HiCacheLayerWriteState(
            reservation=res, total_layers=4, start_event=FakeEvent(), finish_event=FakeEvent()
        )
    res = build_reservation(with_draft=with_draft)
    return HiCacheLayerWriteState(
        reservation=res,
        total_layers=4,
        start_event=FakeEvent(),
        finish_event=FakeEvent(),
        host_indices=res.host_indices,
        physical_device_indices=res.physical_device_indices,
        draft_host_indices=res.draft_host_indices,
    )


def test_layer_state_rejects_zero_layers() -> None:
    res = build_reservation()
    with pytest.raises(ValidationError) as excinfo:
        HiCacheLayerWriteState(
            reservation=res, total_layers=0, start_event=FakeEvent(), finish_event=FakeEvent()
        )
    assert validation_message(excinfo) == (
        "total_layers=0 must be > 0 (max of target and draft layer counts)"
    )


def test_layer_state_is_done_only_after_every_target_layer_without_a_draft() -> None:
    state = build_state(with_draft=False)
    state.completed_target_layers.update({0, 1, 2})
    assert not state.is_done(4, None)
    state.completed_target_layers.add(3)
    assert state.is_done(4, None)


def test_layer_state_waits_for_draft_layers_beyond_the_target_count() -> None:
    # target 2 layers, draft 4: the ack waits for draft layers 2 and 3 (INV-04, bug class 6/5)
    state = build_state()
    state.completed_target_layers.update({0, 1})
    state.completed_draft_layers.update({0, 1})
    assert not state.is_done(2, 4)
    state.completed_draft_layers.update({2, 3})
    assert state.is_done(2, 4)


def test_layer_state_counts_layers_not_set_sizes() -> None:
    # an out-of-range layer id does not stand in for a missing one
    state = build_state(with_draft=False)
    state.completed_target_layers.update({0, 1, 2, 9})
    assert not state.is_done(4, None)


def test_zero_owned_rank_with_a_draft_waits_for_draft_layers_too() -> None:
    # no draft indices to copy on this rank, but the reservation has a draft component, so the
    # ack is appended at the same layer hook as on the owning ranks (INV-14)
    state = build_state(zero_owned=True)
    assert state.draft_host_indices is None and state.has_draft
    state.completed_target_layers.update(range(4))
    assert not state.is_done(4, 4)
    state.completed_draft_layers.update(range(4))
    assert state.is_done(4, 4)


def test_check_ready_for_ack_names_the_missing_target_and_draft_layers() -> None:
    state = build_state()
    state.completed_target_layers.update({0, 1})
    state.completed_draft_layers.update({0})
    with pytest.raises(InvariantViolation) as excinfo:
        state.check_ready_for_ack(4, 2)
    assert excinfo.value.inv_id == "INV-04"
    assert str(excinfo.value) == (
        "INV-04 violated: write ack for node_id=7 would be appended while target layers [2, 3] "
        "and draft layers [1] are not submitted (append the ack only after the last target and "
        "draft layer copy)"
    )


def test_check_ready_for_ack_passes_when_complete() -> None:
    state = build_state()
    state.completed_target_layers.update(range(3))
    state.completed_draft_layers.update(range(2))
    state.check_ready_for_ack(3, 2)


def test_layer_state_with_a_draft_needs_the_draft_layer_count() -> None:
    state = build_state()
    with pytest.raises(HiCacheInputError, match="pass the draft pool's layer_num"):
        state.is_done(0, None)


def test_layer_state_is_mutable_but_rejects_unknown_fields() -> None:
    state = build_state()
    state.ack_appended = True
    state.draft_physical_device_indices = pages_of(0, 16)
    assert state.ack_appended and state.node_id == 7
    with pytest.raises(ValueError, match="no field"):
        state.acked_twice = True  # type: ignore[attr-defined]
