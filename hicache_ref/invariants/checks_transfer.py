"""Checkers for what a transfer must respect: layer completeness (INV-04), bytes (INV-06), the
per-layer read gate (INV-11), store before backup (INV-12) and cancellation (INV-15).

Ordering checks take positions from a happens-before log (e.g. the simulated device's executed
op list): ``a < b`` means ``a`` completed before ``b`` started on the same stream or across an
event wait. The checkers never look at events themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants._convert import shorten, to_host
from hicache_ref.invariants.models import HiCacheLayerWriteState


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


def check_layer_write_complete(
    state: HiCacheLayerWriteState, target_layer_num: int, draft_layer_num: int | None
) -> None:
    """Raise INV-04 unless ``state`` may append its ack (see ``check_ready_for_ack``)."""
    state.check_ready_for_ack(target_layer_num, draft_layer_num)


def check_load_finish_after_copies(
    node_ids: Sequence[int],
    finish_position: int,
    copy_positions: Mapping[str, Mapping[int, int]],
) -> None:
    """Raise INV-04 unless a load ack's finish event follows every layer copy of its op.

    ``copy_positions[pool][layer]`` is where the H2D of ``layer`` into ``pool`` (``"target"``,
    ``"draft"``) sits in the happens-before log; ``finish_position`` is where the ack's finish
    event was recorded. The seed records ``load_events[layer_num - 1]`` as the finish, so with
    more draft than target layers the draft tail lands after the ack (bug class 6).
    """
    for pool in sorted(copy_positions):
        for layer, position in sorted(copy_positions[pool].items()):
            # Verify this copy precedes the finish event
            if position > finish_position:
                raise InvariantViolation(
                    "INV-04",
                    f"load ack for node_ids {list(node_ids)} finishes at position "
                    f"{finish_position}, before the {pool} layer {layer} copy at position "
                    f"{position} (record the finish event after the last target and draft copy)",
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


def check_layer_landed_before_read(
    layer_id: int, landed_layers: Collection[int], *, pool: str = "target", consumer_index: int = -1
) -> None:
    """Raise INV-11 if a forward reads ``layer_id`` of a loading batch before it landed.

    ``landed_layers`` are the layers whose H2D completed when the read started. Reading
    earlier returns whatever the page held before (sglang#7267, bug class 8).
    """
    # Verify the layer landed before the forward reads it
    if layer_id not in landed_layers:
        raise InvariantViolation(
            "INV-11",
            f"forward read {pool} layer {layer_id} of producer slot {consumer_index} before it "
            f"landed (landed: {shorten(sorted(landed_layers))}; wait_until({layer_id}) on the "
            "consumer slot first)",
        )


def check_store_before_backup(node_id: int, layer_id: int, stored_layers: Collection[int]) -> None:
    """Raise INV-12 if layer ``layer_id``'s D2H for ``node_id`` started before that layer's store.

    ``stored_layers`` are the node's layers whose forward KV store had completed when the
    per-layer D2H started. Otherwise the host copy holds pre-store bytes (bug class 11,
    vLLM#45704).
    """
    # Verify the layer's KV store happened before its backup copy
    if layer_id not in stored_layers:
        raise InvariantViolation(
            "INV-12",
            f"per-layer D2H of node_id={node_id} layer {layer_id} started before that layer's "
            "KV store (record a layer event on the forward stream and make the write stream "
            "wait on it)",
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


def check_cancel_quiesced(
    cancelled_node_ids: Collection[int],
    later_copy_node_ids: Iterable[int],
    later_ack_rows: Sequence[Sequence[int]],
) -> None:
    """Raise INV-15 if a node cancelled by ``cancel_layer_write_state`` is touched afterwards.

    ``later_copy_node_ids`` are the nodes of per-layer copies issued after the cancel;
    ``later_ack_rows`` the write acks appended after it. A stale state keeps copying into
    slots the rollback freed and acks a node the tree forgot (bug class 12).
    """
    for node_id in later_copy_node_ids:
        # Verify no layer hook copies for a cancelled node
        if node_id in cancelled_node_ids:
            raise InvariantViolation(
                "INV-15",
                f"a layer hook copied into node_id={node_id}'s host slots after "
                "cancel_layer_write_state dropped it (the state must be gone from "
                "pending_layer_writes)",
            )
    for row_index, row in enumerate(later_ack_rows):
        for node_id in row:
            # Verify no ack is appended for a cancelled node
            if node_id in cancelled_node_ids:
                raise InvariantViolation(
                    "INV-15",
                    f"write ack row {row_index} appended after the cancel carries cancelled "
                    f"node_id={node_id} (a cancelled write is never acked)",
                )
