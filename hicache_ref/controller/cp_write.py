"""Context-parallel (CP) shared-KV write-back, layer by layer while the forward runs.

Under CP every rank holds only the pages it owns (``CpSharedKVLayout``). A backup is:
``reserve_write_cp`` (pad to a page boundary, record the owner pattern, allocate host slots for
this rank's owned pages only) -> per-layer submits, either from the forward's layer-end hooks
(``on_layer_end``) or caught up at once (``submit_write_cp_per_layer``) -> when every target and
draft layer was submitted, exactly one write ack for the node (INV-02, INV-04). Each layer's D2H
waits on an event recorded on the forward stream after that layer's KV store (INV-12).
``cancel_layer_write_state`` rolls a reservation back (INV-15).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.base import ControllerState, logger
from hicache_ref.controller.operations import CacheOperation, HiCacheAck
from hicache_ref.controller.rollback import rolled_back_on_failure, take_checkpoint
from hicache_ref.errors import HiCacheInputError, InvariantViolation, LayerRangeError
from hicache_ref.pools.page_index import get_small_cpu_values

if TYPE_CHECKING:
    from hicache_ref.invariants.models import (
        HiCacheLayerWriteState,
        HiCacheWriteFailure,
        HiCacheWriteReservation,
        HiCacheWriteResult,
    )
    from hicache_ref.pools.cp_layout import CpSharedKVLayout


class CpWriteMixin(ControllerState):
    """``reserve_write_cp`` and the per-layer write states it drives."""

    def _require_cp_layout(self) -> None:
        if self.cp_shared_kv_layout is None:
            raise HiCacheInputError(
                "this controller has no cp_shared_kv_layout (CP methods need one at construction)"
            )

    def reserve_write_cp(
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
    ) -> HiCacheWriteReservation | HiCacheWriteFailure:
        """Reserve host slots for this rank's owned pages of ``device_indices`` (logical locs)."""
        from hicache_ref.invariants.models import (
            CpHiCacheNodeMetadata,
            HiCacheWriteFailure,
            HiCacheWriteReservation,
        )
        from hicache_ref.pools.page_index import pad_token_locs_to_page_boundary

        self._require_cp_layout()
        layout = self.cp_shared_kv_layout
        assert layout is not None  # narrowed by _require_cp_layout
        self._check_indices(device_indices, "device_indices", page_aligned=False)
        # Verify no undrained ack or pending state for this node: a second reservation would
        # append a second ack for one radix registration (INV-02, bug class 1)
        if node_id >= 0 and (
            self.node_has_undrained_write_ack(node_id) or node_id in self.pending_layer_writes
        ):
            logger.debug("reserve_write_cp refused: node %d has an undrained write", node_id)
            return HiCacheWriteFailure(required_host_slots=0, reason="undrained_ack")

        page_size = self.page_size
        logical_len = len(device_indices)
        padded = pad_token_locs_to_page_boundary(
            device_indices, page_size, "CP HiCache write device_indices"
        )
        padded_len = int(padded.numel())
        owned_positions, physical, page_owners = _plan_owned(layout, padded)
        empty = torch.empty((0,), dtype=torch.int64)
        if owned_positions.numel() == 0:
            draft_empty = empty.clone() if self.has_draft_hicache else None
            return HiCacheWriteReservation(
                metadata=CpHiCacheNodeMetadata(
                    logical_len=logical_len,
                    padded_len=padded_len,
                    owned_positions=owned_positions,
                    host_indices=empty,
                    page_owners=page_owners,
                    page_size=page_size,
                    draft_host_indices=draft_empty,
                ),
                host_indices=empty,
                physical_device_indices=empty,
                node_id=node_id,
                priority=priority,
                draft_host_indices=draft_empty.clone() if draft_empty is not None else None,
            )

        host_indices = self.mem_pool_host.alloc_contiguous_preferred(len(physical))
        if host_indices is None:
            return HiCacheWriteFailure(required_host_slots=len(physical))
        draft_host_indices = None
        if self.has_draft_hicache:
            _, draft_host_pool = self._require_draft_pools()
            draft_host_indices = draft_host_pool.alloc_contiguous_preferred(len(physical))
            if draft_host_indices is None:
                # Nothing half-allocated after a refusal (INV-17)
                self.mem_pool_host.free(host_indices)
                return HiCacheWriteFailure(
                    required_host_slots=len(physical), reason="draft_host_capacity"
                )
        try:
            metadata = CpHiCacheNodeMetadata(
                logical_len=logical_len,
                padded_len=padded_len,
                owned_positions=owned_positions,
                host_indices=host_indices.cpu(),
                page_owners=page_owners,
                page_size=page_size,
                draft_host_indices=(
                    draft_host_indices.cpu() if draft_host_indices is not None else None
                ),
            )
            reservation = HiCacheWriteReservation(
                metadata=metadata,
                host_indices=host_indices,
                physical_device_indices=physical,
                node_id=node_id,
                priority=priority,
                draft_host_indices=draft_host_indices,
            )
        except Exception:
            self.mem_pool_host.free(host_indices)
            if draft_host_indices is not None and self.draft_mem_pool_host is not None:
                self.draft_mem_pool_host.free(draft_host_indices)
            raise
        return reservation

    def submit_write_cp_all_layer(self, reservation: HiCacheWriteReservation) -> None:
        """Back up a reservation with one all-layer D2H (the fallback path)."""
        node_id = reservation.node_id
        # Refuse a second backup before any copy is issued (INV-02, INV-17)
        if node_id >= 0 and (
            self.node_has_undrained_write_ack(node_id) or node_id in self.pending_layer_writes
        ):
            raise InvariantViolation(
                "INV-02",
                f"submit_write_cp_all_layer for node {node_id} while its previous write is "
                "pending or its ack undrained (drain it with writing_check first)",
            )
        if len(reservation.physical_device_indices) == 0:
            # A zero-owned rank still acks, so every rank's ack rows stay identical (INV-14)
            self._append_completed_write_ack(reservation.node_id)
            return
        queued = len(self.write_queue), len(self.draft_write_queue)
        self.write_queue.append(
            CacheOperation(
                reservation.host_indices,
                reservation.physical_device_indices,
                reservation.node_id,
                reservation.priority,
            )
        )
        if reservation.draft_host_indices is not None:
            self.draft_write_queue.append(
                CacheOperation(
                    reservation.draft_host_indices,
                    reservation.physical_device_indices,
                    reservation.node_id,
                    reservation.priority,
                )
            )
        try:
            self.start_writing()
        except BaseException:
            # start_writing rolled itself back; drop this call's ops (the slots are the caller's)
            del self.write_queue[queued[0] :]
            del self.draft_write_queue[queued[1] :]
            raise

    def _get_or_create_layer_write_state(
        self, reservation: HiCacheWriteReservation
    ) -> HiCacheLayerWriteState:
        from hicache_ref.invariants.models import HiCacheLayerWriteState

        state = self.pending_layer_writes.get(reservation.node_id)
        if state is not None:
            if state.reservation is not reservation:
                raise InvariantViolation(
                    "INV-02",
                    f"a second per-layer reservation for node {reservation.node_id} while the "
                    "first is pending (cancel_layer_write_state or wait for its ack)",
                )
            return state
        if reservation.node_id >= 0 and self.node_has_undrained_write_ack(reservation.node_id):
            raise InvariantViolation(
                "INV-02",
                f"per-layer write for node {reservation.node_id} while its previous write ack "
                "is undrained (drain it with writing_check first)",
            )
        draft_layers = self.draft_layer_num if reservation.draft_host_indices is not None else 0
        state = HiCacheLayerWriteState(
            reservation=reservation,
            total_layers=max(self.layer_num, draft_layers),
            start_event=self.device_module.Event(),
            finish_event=self.device_module.Event(),
        )
        if len(reservation.physical_device_indices) > 0:
            op = CacheOperation(
                reservation.host_indices,
                reservation.physical_device_indices,
                reservation.node_id,
                reservation.priority,
            )
            state.host_indices, state.physical_device_indices = self.move_indices(
                op, self.mem_pool_host
            )
            if reservation.draft_host_indices is not None:
                _, draft_host_pool = self._require_draft_pools()
                draft_op = CacheOperation(
                    reservation.draft_host_indices,
                    reservation.physical_device_indices,
                    reservation.node_id,
                    reservation.priority,
                )
                # Keep the draft pairing of its own: move_indices may sort the draft host
                # indices differently from the target's (the seed reused the target-permuted
                # device indices here, swapping draft rows; bug class 17).
                (
                    state.draft_host_indices,
                    state.draft_physical_device_indices,
                ) = self.move_indices(draft_op, draft_host_pool)
        self.pending_layer_writes[reservation.node_id] = state
        state.start_event.record()
        return state

    def _layer_write_state_done(self, state: HiCacheLayerWriteState) -> bool:
        draft_layers = (
            self.draft_layer_num if state.reservation.draft_host_indices is not None else None
        )
        return state.is_done(self.layer_num, draft_layers)

    def _append_layer_write_ack(self, state: HiCacheLayerWriteState) -> None:
        if state.ack_appended:
            return
        draft_layers = (
            self.draft_layer_num if state.reservation.draft_host_indices is not None else None
        )
        # Verify every target and draft layer was submitted before the ack (INV-04, bug class 5)
        state.check_ready_for_ack(self.layer_num, draft_layers)
        state.ack_appended = True
        node_id = state.reservation.node_id
        self.pending_layer_writes.pop(node_id, None)
        self.inflight.add(
            "per-layer write",
            [node_id],
            state.finish_event,
            {
                "host": self._pages(state.host_indices),
                "device": self._pages(state.physical_device_indices),
                "draft_host": self._pages(state.draft_host_indices),
            },
        )
        self._append_write_ack(HiCacheAck(state.start_event, state.finish_event, [node_id]))

    def _submit_write_cp_layer_states(
        self,
        states: list[HiCacheLayerWriteState],
        layer_id: int,
        *,
        submit_target: bool = True,
        submit_draft: bool = True,
    ) -> None:
        """Submit one layer for a group of reservations as one target and one draft D2H."""
        unique: list[HiCacheLayerWriteState] = []
        for state in states:
            if all(state is not u for u in unique):
                unique.append(state)
        for state in unique:
            if not 0 <= layer_id < state.total_layers:
                raise LayerRangeError(
                    f"layer_id={layer_id} is outside the CP backup layer range "
                    f"[0, {state.total_layers}) for node_id={state.reservation.node_id}"
                )
        draft_layers = self.draft_layer_num
        target_states = [
            s
            for s in unique
            if submit_target
            and layer_id < self.layer_num
            and layer_id not in s.completed_target_layers
        ]
        draft_states = [
            s
            for s in unique
            if submit_draft
            and s.has_draft
            and layer_id < draft_layers
            and layer_id not in s.completed_draft_layers
        ]
        if not target_states and not draft_states:
            return
        # identity, not ==: pydantic's __eq__ would compare tensors element-wise
        chosen = {id(s) for s in target_states} | {id(s) for s in draft_states}
        active = [s for s in unique if id(s) in chosen]

        node_ids = [s.reservation.node_id for s in active]
        # A copy that fails to launch leaves every state's progress and the acks as they were
        with rolled_back_on_failure(self, "CP per-layer write", node_ids, self.write_stream):
            self._issue_layer_write(active, target_states, draft_states, layer_id)

    def _issue_layer_write(
        self,
        active: list[HiCacheLayerWriteState],
        target_states: list[HiCacheLayerWriteState],
        draft_states: list[HiCacheLayerWriteState],
        layer_id: int,
    ) -> None:
        """Launch layer ``layer_id``'s D2H for these states; ack each state it completes."""
        # The layer's KV store was queued on the current (forward) stream; the D2H waits on it
        layer_event = self.device_module.Event()
        layer_event.record()
        for state in active:
            state.layer_events.append(layer_event)
        target_moving = [s for s in target_states if _has_pages(s.physical_device_indices)]
        draft_moving = [
            s
            for s in draft_states
            if s.draft_host_indices is not None and _has_pages(s.physical_device_indices)
        ]
        with self.device_module.stream(self.write_stream):
            for state in active:
                state.start_event.wait(self.write_stream)
            layer_event.wait(self.write_stream)
            if target_moving:
                self.mem_pool_host.backup_from_device_per_layer(
                    self.mem_pool_device,
                    _cat([s.host_indices for s in target_moving]),
                    _cat([s.physical_device_indices for s in target_moving]),
                    layer_id,
                    self.io_backend,
                )
            if draft_moving:
                draft_device_pool, draft_host_pool = self._require_draft_pools()
                draft_host_pool.backup_from_device_per_layer(
                    draft_device_pool,
                    _cat([s.draft_host_indices for s in draft_moving]),
                    _cat([s.draft_physical_device_indices for s in draft_moving]),
                    layer_id,
                    self.io_backend,
                )
            for state in target_states:
                state.completed_target_layers.add(layer_id)
            for state in draft_states:
                state.completed_draft_layers.add(layer_id)
            finished = [s for s in active if self._layer_write_state_done(s) and not s.ack_appended]
            for state in finished:
                state.finish_event.record()
        for state in finished:
            self._append_layer_write_ack(state)

    def submit_write_cp_layer(
        self,
        reservation: HiCacheWriteReservation,
        layer_id: int,
        *,
        submit_target: bool = True,
        submit_draft: bool = True,
    ) -> None:
        """Submit one layer of a reservation; the ack follows the last target/draft layer."""
        draft_layers = self.draft_layer_num if reservation.draft_host_indices is not None else 0
        total_layers = max(self.layer_num, draft_layers)
        if not 0 <= layer_id < total_layers:
            # Refuse before registering any state, so a refusal leaves nothing pending (INV-17)
            raise LayerRangeError(
                f"layer_id={layer_id} is outside the CP backup layer range [0, {total_layers}) "
                f"for node_id={reservation.node_id}"
            )
        saved = take_checkpoint(self)
        state = self._get_or_create_layer_write_state(reservation)
        # A failed launch also forgets a state this call registered
        with rolled_back_on_failure(
            self, "submit_write_cp_layer", [reservation.node_id], self.write_stream, saved
        ):
            self._submit_write_cp_layer_states(
                [state], layer_id, submit_target=submit_target, submit_draft=submit_draft
            )

    def submit_write_cp_per_layer(
        self, reservation: HiCacheWriteReservation, *, catch_up_all_layers: bool = True
    ) -> None:
        """Register a reservation for per-layer backup; optionally submit every layer now."""
        saved = take_checkpoint(self)
        state = self._get_or_create_layer_write_state(reservation)
        if not catch_up_all_layers:
            return
        # A launch failing at layer k also takes back layers 0 .. k-1 of this catch-up
        with rolled_back_on_failure(
            self, "submit_write_cp_per_layer", [reservation.node_id], self.write_stream, saved
        ):
            for layer_id in range(state.total_layers):
                self.submit_write_cp_layer(reservation, layer_id)

    def _write_cp(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> HiCacheWriteResult | HiCacheWriteFailure:
        from hicache_ref.invariants.models import HiCacheWriteFailure, HiCacheWriteResult

        reservation = self.reserve_write_cp(device_indices, priority, node_id)
        if isinstance(reservation, HiCacheWriteFailure):
            return reservation
        try:
            self.submit_write_cp_per_layer(reservation)
        except BaseException:
            # The submit rolled itself back; free the slots this call reserved (INV-17)
            self._free_reservation(reservation)
            raise
        return HiCacheWriteResult(metadata=reservation.metadata)

    def _free_reservation(self, reservation: HiCacheWriteReservation) -> None:
        if len(reservation.host_indices):
            self.mem_pool_host.free(reservation.host_indices)
        draft_host = reservation.draft_host_indices
        if draft_host is not None and len(draft_host) and self.draft_mem_pool_host is not None:
            self.draft_mem_pool_host.free(draft_host)

    def on_layer_end(self, layer_id: int, source: str = "target") -> None:
        """Layer-end hook of the device pools: submit ``layer_id`` for every pending state."""
        if source not in ("target", "draft"):
            raise HiCacheInputError(
                f"unknown layer backup source {source!r}; legal values: target, draft"
            )
        if not self.pending_layer_writes:
            return
        self._submit_write_cp_layer_states(
            list(self.pending_layer_writes.values()),
            layer_id,
            submit_target=source == "target",
            submit_draft=source == "draft",
        )

    def cancel_layer_write_state(self, node_id: int) -> bool:
        """Drop a pending per-layer write (rollback); issued copies finish before this returns."""
        state = self.pending_layer_writes.pop(node_id, None)
        if state is None:
            return False
        # Already-issued per-layer copies must land before the caller frees the slots (INV-15)
        self.write_stream.synchronize()
        return True


def _plan_owned(
    layout: CpSharedKVLayout, padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owned positions, their physical locs, each page's owner as int8) of padded logical locs;
    a small CPU tensor is planned in Python (``plan_owned_of_list``), the same three tensors."""
    values = get_small_cpu_values(padded)
    if values is not None:
        positions, physical, owners = layout.plan_owned_of_list(values)
        return (
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(physical, dtype=padded.dtype),
            torch.tensor(owners, dtype=torch.int8),
        )
    page_size = layout.page_size
    owned_mask = layout.owned_by_this_rank(padded)
    owned_positions = owned_mask.nonzero(as_tuple=True)[0].cpu()
    logical_pages = torch.div(padded[::page_size], page_size, rounding_mode="floor")
    page_owners = layout.owner_for_logical_pages(logical_pages).to(dtype=torch.int8, device="cpu")
    return owned_positions, layout.logical_locs_to_physical(padded[owned_mask]), page_owners


def _has_pages(indices: torch.Tensor | None) -> bool:
    return indices is not None and len(indices) > 0


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    present = [t for t in tensors if t is not None]
    return present[0] if len(present) == 1 else torch.cat(present)
