"""The controller's small records: queued operations, acks and the per-layer load counter.

Data flows: a ``CacheOperation`` is queued -> merged (``merge_ops``) -> its transfer is issued on a
stream -> a ``HiCacheAck`` (start, finish, node ids) is appended -> the tree drains the ack once
``finish_event.query()`` is True. Loads additionally record one event per layer in a producer slot
of the ``LayerDoneCounter``; the forward pass waits on the consumer slot before reading layer i.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from hicache_ref.device.protocol import DeviceModule, EventT, StreamT
from hicache_ref.errors import InvariantViolation, LayerRangeError
from hicache_ref.pools.layer_records import LayerRecords


class LayerLoadingEvent:
    """The events of one producer slot: a start event, one per target/draft layer, a finish."""

    def __init__(self, num_layers: int, device_module: DeviceModule, num_draft_layers: int = 0):
        self._num_layers = num_layers
        self._device_module = device_module
        self.start_event: EventT = device_module.Event()
        self.load_events: list[EventT] = [device_module.Event() for _ in range(num_layers)]
        self.draft_load_events: list[EventT] = [
            device_module.Event() for _ in range(num_draft_layers)
        ]
        # A dedicated finish event, recorded after every target AND draft layer: the seed used
        # load_events[-1], which a longer draft tail lands after (bug class 6, INV-04).
        self.finish_event: EventT = device_module.Event()
        self._records: LayerRecords | None = None

    def set_num_draft_layers(self, num_draft_layers: int) -> None:
        self.draft_load_events = [self._device_module.Event() for _ in range(num_draft_layers)]
        self._records = None

    def layer_records(self) -> LayerRecords:
        """What a load without draft copies records after target layer ``i``: its load event,
        then draft layer ``i + 1``'s (draft layer 0 is recorded before the first copy, the
        layers past the target's after the last). Kept with the slot, so a CUDA load hands the
        same handles to the copy engine every time (``pools.layer_records``)."""
        if self._records is None:
            drafts = len(self.draft_load_events)
            self._records = LayerRecords(
                {
                    i: (self.load_events[i],)
                    + ((self.draft_load_events[i + 1],) if i + 1 < drafts else ())
                    for i in range(self._num_layers)
                }
            )
        return self._records

    def complete(self, layer_index: int) -> None:
        """Mark target layer ``layer_index`` landed (recorded on the current = load stream)."""
        self._check_layer(layer_index, self._num_layers, "target")
        self.load_events[layer_index].record()

    def complete_draft(self, layer_index: int) -> None:
        self._check_layer(layer_index, len(self.draft_load_events), "draft")
        self.draft_load_events[layer_index].record()

    def wait(self, layer_index: int) -> None:
        self.wait_on_stream(layer_index, self._device_module.current_stream())

    def wait_on_stream(self, layer_index: int, stream: StreamT) -> None:
        self._check_layer(layer_index, self._num_layers, "target")
        stream.wait_event(self.load_events[layer_index])

    def wait_draft_on_stream(self, layer_index: int, stream: StreamT) -> None:
        self._check_layer(layer_index, len(self.draft_load_events), "draft")
        stream.wait_event(self.draft_load_events[layer_index])

    @staticmethod
    def _check_layer(layer_index: int, num_layers: int, kind: str) -> None:
        if not 0 <= layer_index < num_layers:
            raise LayerRangeError(f"{kind} layer_index={layer_index} is outside [0, {num_layers})")


class LayerDoneCounter:
    """Producer/consumer slots of per-layer load events (SGLang's ``LayerDoneCounter``).

    ``start_loading`` takes the next producer slot; the scheduler sets the consumer slot(s) of the
    batch about to run; ``get_key_buffer(i)`` calls ``wait_until(i)`` so the forward stream waits
    until layer i of every consumer slot landed (INV-11).
    """

    def __init__(self, num_layers: int, device_module: DeviceModule, num_counters: int = 5):
        if num_counters < 2:
            raise LayerRangeError(f"num_counters={num_counters} must be >= 2 (overlap mode)")
        self.num_layers = num_layers
        self.num_counters = num_counters
        self._device_module = device_module
        self.events = [LayerLoadingEvent(num_layers, device_module) for _ in range(num_counters)]
        self.producer_index = -1
        self.consumer_index = -1
        self.consumer_indices: list[int] = []

    def set_num_draft_layers(self, num_draft_layers: int) -> None:
        for event in self.events:
            event.set_num_draft_layers(num_draft_layers)

    def update_producer(self) -> int:
        """Advance to the next producer slot; it must have finished its previous load (INV-10)."""
        next_index = (self.producer_index + 1) % self.num_counters
        # Verify the slot's previous load finished: reusing it would re-record events that a
        # consumer may still be waiting on, so the forward could read un-landed KV (bug class 7).
        if not self.events[next_index].finish_event.query():
            raise InvariantViolation(
                "INV-10",
                f"producer slot {next_index} reused while its previous load is still in flight "
                f"(keep undrained load acks below num_counters={self.num_counters}: drain "
                "acks with loading_check before start_loading)",
            )
        self.producer_index = next_index
        return next_index

    def set_consumer(self, index: int | Sequence[int] | set[int]) -> None:
        if isinstance(index, (list, tuple, set)):
            indices = [int(i) for i in index if int(i) >= 0]
        else:
            indices = [int(index)] if int(index) >= 0 else []  # type: ignore[arg-type]
        for i in indices:
            if i >= self.num_counters:
                raise LayerRangeError(
                    f"consumer index {i} is outside [0, {self.num_counters}) "
                    "(pass the producer id returned by start_loading, or -1)"
                )
        self.consumer_indices = indices
        self.consumer_index = indices[0] if indices else -1

    def wait_until(self, threshold: int) -> None:
        self.wait_until_on_stream(threshold, self._device_module.current_stream())

    def wait_until_on_stream(self, threshold: int, stream: StreamT) -> None:
        for consumer_index in self.consumer_indices:
            self.events[consumer_index].wait_on_stream(threshold, stream)

    def wait_until_draft_on_stream(self, threshold: int, stream: StreamT) -> None:
        for consumer_index in self.consumer_indices:
            self.events[consumer_index].wait_draft_on_stream(threshold, stream)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
        self.consumer_indices = []


class DraftLayerCounterView:
    """What a draft device pool registers as its transfer counter: waits on draft-layer events."""

    def __init__(self, counter: LayerDoneCounter, device_module: DeviceModule) -> None:
        self._counter = counter
        self._device_module = device_module

    def wait_until(self, threshold: int) -> None:
        self._counter.wait_until_draft_on_stream(threshold, self._device_module.current_stream())


class CacheOperation:
    """One queued transfer: host indices, device indices and the node ids it acks."""

    counter = 0

    def __init__(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        node_id: int,
        priority: int | None = None,
    ) -> None:
        self.host_indices = host_indices
        self.device_indices = device_indices
        self.node_ids: list[int] = [node_id]
        self.data: object = None
        self.id = CacheOperation.counter
        CacheOperation.counter += 1
        self.priority = priority if priority is not None else self.id

    @staticmethod
    def merge_ops(ops: Sequence[CacheOperation]) -> CacheOperation:
        """Concatenate ops in list order: host with host, device with device, node ids in order."""
        if not ops:
            raise ValueError("merge_ops needs at least one CacheOperation")
        if len(ops) == 1:
            return ops[0]
        merged = CacheOperation(
            torch.cat([op.host_indices for op in ops]),
            torch.cat([op.device_indices for op in ops]),
            -1,
            min(op.priority for op in ops),
        )
        merged.node_ids = [node_id for op in ops for node_id in op.node_ids]
        return merged

    def __lt__(self, other: CacheOperation) -> bool:
        return self.priority < other.priority


class HiCacheAck(NamedTuple):
    """An ack the tree drains once ``finish_event.query()`` is True (FIFO prefix only, INV-09)."""

    start_event: EventT
    finish_event: EventT
    node_ids: list[int]


def ack_node_id_rows(acks: Iterable[HiCacheAck]) -> list[list[int]]:
    """The node-id rows of an ack queue, for checkers (INV-02, INV-14)."""
    return [list(ack.node_ids) for ack in acks]
