"""Records that carry invariants: CP node metadata, write results, reservations, layer writes.

Names, fields and defaults follow the seed controller's dataclasses (HiCacheWriteResult,
HiCacheWriteFailure, HiCacheWriteReservation, HiCacheLayerWriteState) and the fork's
``CpHiCacheNodeMetadata``, so code written against SGLang can construct them with keywords.
Three differences on purpose:

- the records are validated: a broken rule raises ``pydantic.ValidationError`` whose message
  starts with the invariant id (``INV-13: padded_len=20 is not a multiple of page_size=16``);
- ``HiCacheWriteFailure.reason`` is a closed set, and adds ``"draft_host_capacity"`` so a
  shortfall of the draft host pool is not mistaken for a target host shortfall;
- ``HiCacheLayerWriteState`` knows when it is complete (``is_done``) and refuses an early ack
  (``check_ready_for_ack``, INV-04).

Hot path: ``reserve_write_cp`` builds one metadata record per write. Validation never reads the
values of a tensor that is not on the CPU, because that would synchronize a CUDA stream; on
such tensors only shapes, lengths and dtypes are checked (``rules.is_host_readable``).
``benchmarks/bench_metadata_validation.py`` measures what validation costs.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, field_validator, model_validator

from hicache_ref.device.protocol import Event
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.invariants.rules import (
    Problem,
    find_cp_metadata_problem,
    find_page_misalignment,
    is_host_readable,
)

WriteFailureReason = Literal["host_capacity", "undrained_ack", "draft_host_capacity"]
"""Why a write reservation failed; a refusal must name its actual cause (INV-17).

- ``host_capacity``: the target host pool is short; the caller may evict host copies and retry.
- ``draft_host_capacity``: the draft host pool is short; evicting target host copies frees
  draft slots only if the caller's eviction covers the draft pool too.
- ``undrained_ack``: the node's previous write ack is still queued (INV-02); skip this round.
"""


def _raise_problem(problem: Problem | None) -> None:
    """Turn a rule's problem into the ``ValueError`` pydantic reports as a ValidationError."""
    if problem is not None:
        raise ValueError(str(problem))


class CpHiCacheNodeMetadata(BaseModel):
    """What one CP rank recorded about a node's host backup, enough to load it back (INV-13).

    ``owned_positions`` are the positions, within the node's padded device span, of the tokens
    on pages this rank owns; ``host_indices[k]`` holds position ``owned_positions[k]``.
    ``page_owners`` is the owner rank of every logical page (identical on all ranks), which
    ``load_cp`` replays so the positions index an allocation with the same owners (INV-03).
    """

    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        frozen=True,
        strict=True,
        hide_input_in_errors=True,
    )

    logical_len: int
    padded_len: int
    page_size: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    page_owners: torch.Tensor
    draft_host_indices: Optional[torch.Tensor] = None

    @property
    def valid_len(self) -> int:
        """Tokens of the node visible to attention: the logical, unpadded length."""
        return self.logical_len

    @property
    def num_pages(self) -> int:
        """Logical pages the node spans once padded."""
        return self.padded_len // self.page_size

    @model_validator(mode="after")
    def _check_metadata(self) -> CpHiCacheNodeMetadata:
        # Verify the INV-13 length, shape and (CPU-only) value rules, and INV-01 host alignment
        _raise_problem(
            find_cp_metadata_problem(
                logical_len=self.logical_len,
                padded_len=self.padded_len,
                page_size=self.page_size,
                owned_positions=self.owned_positions,
                host_indices=self.host_indices,
                page_owners=self.page_owners,
                draft_host_indices=self.draft_host_indices,
            )
        )
        return self


def _check_slot_count(value: int) -> int:
    if value < 0:
        raise ValueError(f"required_host_slots={value} must be >= 0")
    return value


class HiCacheWriteResult(BaseModel):
    """A CP write that was reserved and submitted; ``metadata`` goes on the radix node."""

    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        frozen=True,
        strict=True,
        hide_input_in_errors=True,
    )

    metadata: object
    required_host_slots: int = 0

    _check_required_host_slots = field_validator("required_host_slots")(_check_slot_count)


class HiCacheWriteFailure(BaseModel):
    """A write that could not be reserved: a capacity shortfall is a value, not an exception."""

    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        frozen=True,
        strict=True,
        hide_input_in_errors=True,
    )

    required_host_slots: int
    metadata: object | None = None
    reason: WriteFailureReason = "host_capacity"

    _check_required_host_slots = field_validator("required_host_slots")(_check_slot_count)


class HiCacheWriteReservation(BaseModel):
    """Host (and draft host) slots reserved for one CP node's backup, not yet submitted.

    ``host_indices[k]`` receives ``physical_device_indices[k]``; the draft copy, when present,
    goes to ``draft_host_indices[k]`` from the same device slot. A zero-owned rank holds empty
    tensors and still takes part in the ack protocol (INV-14).
    """

    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        frozen=True,
        strict=True,
        hide_input_in_errors=True,
    )

    metadata: CpHiCacheNodeMetadata
    host_indices: torch.Tensor
    physical_device_indices: torch.Tensor
    node_id: int = -1
    priority: Optional[int] = None
    draft_host_indices: Optional[torch.Tensor] = None
    required_host_slots: int = 0

    @model_validator(mode="after")
    def _check_reservation(self) -> HiCacheWriteReservation:
        # Verify host, device and draft index lists pair up one to one (INV-13)
        if (self.draft_host_indices is None) != (self.metadata.draft_host_indices is None):
            raise ValueError(
                "INV-13: the reservation and its metadata disagree on having a draft copy "
                f"(reservation: {self.draft_host_indices is not None}, metadata: "
                f"{self.metadata.draft_host_indices is not None}); both or neither"
            )
        count = self.host_indices.numel()
        for name, tensor in (
            ("physical_device_indices", self.physical_device_indices),
            ("draft_host_indices", self.draft_host_indices),
            ("metadata.host_indices", self.metadata.host_indices),
        ):
            if tensor is not None and tensor.numel() != count:
                raise ValueError(
                    f"INV-13: len({name})={tensor.numel()} but len(host_indices)={count} "
                    "(each reserved host slot pairs with one device slot)"
                )
        # Verify the spans handed to the D2H are whole aligned pages (INV-01), CPU tensors only
        page_size = self.metadata.page_size
        for name, tensor in (
            ("host_indices", self.host_indices),
            ("physical_device_indices", self.physical_device_indices),
            ("draft_host_indices", self.draft_host_indices),
        ):
            already_checked = tensor is self.metadata.host_indices or (
                tensor is self.metadata.draft_host_indices
            )
            if tensor is not None and not already_checked and is_host_readable(tensor):
                _raise_problem(find_page_misalignment(tensor, page_size, f"reservation.{name}"))
        return self


class HiCacheLayerWriteState(BaseModel):
    """Progress of one node's per-layer D2H backup, from registration to its single ack.

    Mutable: the layer hooks add to ``completed_target_layers``/``completed_draft_layers``
    and ``ack_appended`` flips once (INV-02). ``host_indices``/``physical_device_indices``/
    ``draft_host_indices`` are the reservation's indices after ``move_indices`` (None on a
    zero-owned rank, which copies nothing but still counts layers).
    The events are typed as the device seam's ``Event`` but not validated at run time (the
    seed accepts any object, and an isinstance check against a protocol costs on every write).
    ``draft_physical_device_indices`` (not in the seed) are the device indices permuted with
    the draft host indices: ``move_indices`` may sort the draft host list differently from the
    target's, and pairing draft host rows with the target's permutation swaps tokens (bug
    class 17; see specs/upstream_findings.md).
    """

    model_config = ConfigDict(
        arbitrary_types_allowed=True, extra="forbid", strict=True, hide_input_in_errors=True
    )

    reservation: HiCacheWriteReservation
    total_layers: int
    start_event: SkipValidation[Event]
    finish_event: SkipValidation[Event]
    layer_events: SkipValidation[list[Event]] = Field(default_factory=list)
    completed_target_layers: set[int] = Field(default_factory=set)
    completed_draft_layers: set[int] = Field(default_factory=set)
    host_indices: Optional[torch.Tensor] = None
    physical_device_indices: Optional[torch.Tensor] = None
    draft_host_indices: Optional[torch.Tensor] = None
    draft_physical_device_indices: Optional[torch.Tensor] = None
    ack_appended: bool = False

    @field_validator("total_layers")
    @classmethod
    def _check_total_layers(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(
                f"total_layers={value} must be > 0 (max of target and draft layer counts)"
            )
        return value

    @property
    def node_id(self) -> int:
        """The radix node this backup belongs to."""
        return self.reservation.node_id

    @property
    def has_draft(self) -> bool:
        """Whether the backup has a draft component, on this rank or (zero-owned) on others.

        Decided by the reservation, not by ``draft_host_indices``: a zero-owned rank has no
        draft indices to copy, yet must wait for the same draft layers as the owning ranks so
        every rank appends its acks in the same order (INV-14).
        """
        return (
            self.reservation.draft_host_indices is not None or self.draft_host_indices is not None
        )

    def get_missing_target_layers(self, target_layer_num: int) -> list[int]:
        """Target layers below ``target_layer_num`` not yet submitted."""
        done = self.completed_target_layers
        return [layer for layer in range(target_layer_num) if layer not in done]

    def get_missing_draft_layers(self, draft_layer_num: int | None) -> list[int]:
        """Draft layers below ``draft_layer_num`` not yet submitted ([] without a draft)."""
        if not self.has_draft:
            return []
        if draft_layer_num is None:
            raise HiCacheInputError(
                f"node_id={self.node_id} has a draft backup: pass the draft pool's layer_num "
                "as draft_layer_num (got None)"
            )
        done = self.completed_draft_layers
        return [layer for layer in range(draft_layer_num) if layer not in done]

    def is_done(self, target_layer_num: int, draft_layer_num: int | None) -> bool:
        """Whether every target layer and (with a draft) every draft layer was submitted."""
        if not self.completed_target_layers.issuperset(range(target_layer_num)):
            return False
        if not self.has_draft:
            return True
        return not self.get_missing_draft_layers(draft_layer_num)

    def check_ready_for_ack(self, target_layer_num: int, draft_layer_num: int | None) -> None:
        """Raise INV-04 unless every target and draft layer copy was submitted."""
        missing_target = self.get_missing_target_layers(target_layer_num)
        missing_draft = self.get_missing_draft_layers(draft_layer_num)
        if missing_target or missing_draft:
            raise InvariantViolation(
                "INV-04",
                f"write ack for node_id={self.node_id} would be appended while target layers "
                f"{missing_target} and draft layers {missing_draft} are not submitted "
                "(append the ack only after the last target and draft layer copy)",
            )
