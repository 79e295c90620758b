"""Rolling a failed transfer launch back: the call leaves nothing behind (channel 4, INV-17).

A copy can fail to launch half-way through ``start_writing``, ``start_loading`` or a per-layer
CP submit (a host pool's copy raises, the device refuses a launch). The issuing code runs under
``rolled_back_on_failure``: before anything changes, ``take_checkpoint`` saves what a launch
mutates (the op and ack queues, the producer index, the in-flight tracker, the pending per-layer
writes and their progress); on an exception ``restore_checkpoint`` puts all of it back, the
stream that received the failed call's first copies is synchronized (so no stale copy lands in
a slot the caller frees next), and one ``TransferLaunchError`` is raised. Errors of the other
channels (bad input, a broken invariant) keep their type: they are rolled back the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache_ref.controller.base import ControllerState, logger
from hicache_ref.controller.inflight import InflightTransfer
from hicache_ref.controller.operations import CacheOperation, HiCacheAck
from hicache_ref.device.protocol import EventT, StreamT
from hicache_ref.errors import (
    HiCacheFault,
    HiCacheInputError,
    InvariantViolation,
    TransferLaunchError,
)

if TYPE_CHECKING:
    from hicache_ref.invariants.models import HiCacheLayerWriteState


@dataclass(frozen=True)
class LayerWriteProgress:
    """What a per-layer submit changes on one pending write state."""

    state: HiCacheLayerWriteState
    layer_events: list[EventT]
    completed_target_layers: set[int]
    completed_draft_layers: set[int]
    ack_appended: bool


@dataclass(frozen=True)
class LaunchCheckpoint:
    """The controller state a launch may change, saved before it starts."""

    write_queue: list[CacheOperation]
    draft_write_queue: list[CacheOperation]
    load_queue: list[CacheOperation]
    draft_load_queue: list[CacheOperation]
    ack_write_queue: list[HiCacheAck]
    ack_load_queue: list[HiCacheAck]
    max_write_ack_node_id: int
    producer_index: int
    inflight: list[InflightTransfer]
    pending_layer_writes: dict[int, HiCacheLayerWriteState]
    progress: tuple[LayerWriteProgress, ...]


def take_checkpoint(
    c: ControllerState, states: Iterable[HiCacheLayerWriteState] = ()
) -> LaunchCheckpoint:
    """Save the state a launch may change (``states``: per-layer writes not yet registered)."""
    tracked = {id(s): s for s in [*c.pending_layer_writes.values(), *states]}
    return LaunchCheckpoint(
        write_queue=list(c.write_queue),
        draft_write_queue=list(c.draft_write_queue),
        load_queue=list(c.load_queue),
        draft_load_queue=list(c.draft_load_queue),
        ack_write_queue=list(c.ack_write_queue),
        ack_load_queue=list(c.ack_load_queue),
        max_write_ack_node_id=c._max_write_ack_node_id,
        producer_index=c.layer_done_counter.producer_index,
        inflight=c.inflight.snapshot(),
        pending_layer_writes=dict(c.pending_layer_writes),
        progress=tuple(
            LayerWriteProgress(
                s,
                list(s.layer_events),
                set(s.completed_target_layers),
                set(s.completed_draft_layers),
                s.ack_appended,
            )
            for s in tracked.values()
        ),
    )


def restore_checkpoint(c: ControllerState, saved: LaunchCheckpoint) -> None:
    """Put every saved piece back, in place (callers may hold the queue lists)."""
    c.write_queue[:] = saved.write_queue
    c.draft_write_queue[:] = saved.draft_write_queue
    c.load_queue[:] = saved.load_queue
    c.draft_load_queue[:] = saved.draft_load_queue
    c.ack_write_queue[:] = saved.ack_write_queue
    c.ack_load_queue[:] = saved.ack_load_queue
    c._max_write_ack_node_id = saved.max_write_ack_node_id
    c.layer_done_counter.producer_index = saved.producer_index
    c.inflight.restore(saved.inflight)
    c.pending_layer_writes.clear()
    c.pending_layer_writes.update(saved.pending_layer_writes)
    for p in saved.progress:
        p.state.layer_events = list(p.layer_events)
        p.state.completed_target_layers = set(p.completed_target_layers)
        p.state.completed_draft_layers = set(p.completed_draft_layers)
        p.state.ack_appended = p.ack_appended


@contextmanager
def rolled_back_on_failure(
    c: ControllerState,
    action: str,
    node_ids: list[int],
    stream: StreamT,
    saved: LaunchCheckpoint | None = None,
) -> Iterator[None]:
    """Run a launch; on any error restore ``saved``, fence ``stream`` and raise one error."""
    checkpoint = take_checkpoint(c) if saved is None else saved
    try:
        yield
    except BaseException as exc:
        restore_checkpoint(c, checkpoint)
        _fence(stream, action)
        if not isinstance(exc, Exception):
            raise
        if isinstance(exc, (HiCacheFault, HiCacheInputError, InvariantViolation)):
            raise  # already typed: keep its channel (an inner guard rolled back less)
        raise TransferLaunchError(action, node_ids, exc) from exc


def _fence(stream: StreamT, action: str) -> None:
    """Let the copies the failed call did launch land before anyone frees their slots."""
    try:
        stream.synchronize()
    except Exception:
        logger.exception("%s: could not synchronize the stream after a failed launch", action)


def queued_node_ids(*queues: list[CacheOperation]) -> list[int]:
    """The node ids of the first non-empty queue (what its merged op would ack)."""
    for queue in queues:
        if queue:
            return [node_id for op in queue for node_id in op.node_ids]
    return []
