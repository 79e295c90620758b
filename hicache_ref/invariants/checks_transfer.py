"""Checkers for what a transfer must respect: layer completeness (INV-04), bytes (INV-06), the
per-layer read gate (INV-11), store before backup (INV-12) and cancellation (INV-15).

Ordering checks take positions from a happens-before log (e.g. the simulated device's executed
op list): ``a < b`` means ``a`` completed before ``b`` started on the same stream or across an
event wait. The checkers never look at events themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants._convert import shorten, to_host


def check_layers_submitted(
    node_id: int,
    completed_target_layers: Collection[int],
    completed_draft_layers: Collection[int],
    target_layer_num: int,
    draft_layer_num: int | None,
) -> None:
    """Raise INV-04 unless every target layer (and, unless ``draft_layer_num`` is None, every
    draft layer) below its pool's ``layer_num`` was submitted before the write ack.

    An ack appended early is drained while a draft layer was never copied: the draft host copy
    of that layer stays stale and speculative decoding degrades after reload (bug class 5).
    """
    missing_target = [
        layer for layer in range(target_layer_num) if layer not in completed_target_layers
    ]
    missing_draft = (
        []
        if draft_layer_num is None
        else [layer for layer in range(draft_layer_num) if layer not in completed_draft_layers]
    )
    # Verify no target or draft layer is missing
    if missing_target or missing_draft:
        raise InvariantViolation(
            "INV-04",
            f"write ack for node_id={node_id} appended while target layers "
            f"{shorten(missing_target)} and draft layers {shorten(missing_draft)} were not "
            "submitted (append the ack only after the last target and draft layer copy)",
        )


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as raw bytes, one row per leading index (so NaN payloads compare exactly)."""
    flat = to_host(tensor).contiguous()
    rows = flat.reshape(flat.shape[0], -1) if flat.dim() > 0 else flat.reshape(1, 1)
    return rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows


def check_bytes_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    where: str,
    *,
    inv_id: str = "INV-06",
    describe_row: Callable[[torch.Tensor], str] | None = None,
    fix: str = "a round trip must return the bytes that were written",
) -> None:
    """Raise ``inv_id`` unless ``actual`` holds exactly ``expected``'s bytes; names the first bad
    row (decoded by ``describe_row`` when given: who wrote the row found, who should have).

    Rows are the leading dimension (a token slot of a KV buffer). Byte comparison catches what
    ``==`` misses (NaN payloads, -0.0) and works for fp8 stored as uint8. Sidecars (the NSA
    index buffer) and draft pools are checked the same way (sglang#17085, #16964). The harness
    runs the same comparison at an ack drain (INV-09) and in a forward read (INV-11).
    """
    # Verify the two copies have the same layout
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise InvariantViolation(
            inv_id,
            f"{where}: got {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} "
            f"{tuple(expected.shape)} (a copy preserves dtype and shape)",
        )
    if actual.numel() == 0:
        return
    got, want = _as_bytes(actual), _as_bytes(expected)
    if torch.equal(got, want):
        return
    # Verify every row's bytes match; report the first that does not
    row = int(got.ne(want).any(dim=1).nonzero()[0, 0])
    differing = int(got[row].ne(want[row]).sum())
    found = (
        f" holds {describe_row(actual[row])}, expected {describe_row(expected[row])};"
        if describe_row is not None
        else ""
    )
    raise InvariantViolation(
        inv_id,
        f"{where}: row {row}{found} differs from the oracle in {differing} of {got.shape[1]} "
        f"bytes ({int(got.ne(want).any(dim=1).sum())} rows differ; {fix})",
    )


def check_no_stale_layer_writes(
    pending_node_ids: Collection[int], in_flight_node_ids: Collection[int], what: str
) -> None:
    """Raise INV-15 if a per-layer write state is pending for a node whose backup is not in
    flight (cancelled, acked, or forgotten by the tree).

    Such a state keeps copying into slots the tree may free and will ack a node the tree no
    longer backs up (bug class 12).
    """
    stale = sorted(set(pending_node_ids) - set(in_flight_node_ids))
    # Verify every pending state belongs to a backup still in flight
    if stale:
        raise InvariantViolation(
            "INV-15",
            f"{what}: per-layer write states still pending for node ids {shorten(stale)}, whose "
            "backup is not in flight (a cancelled or finished write must leave "
            "pending_layer_writes)",
        )
