"""What a stepped load records after each layer: in Python, or as handles for one native call."""

from __future__ import annotations

import ctypes

from hicache_ref.pools.layer_records import LayerRecords


class Event:
    """A recordable event; ``cuda_event`` is its raw handle (0 until created, as torch's)."""

    def __init__(self, handle: int, log: list[int]) -> None:
        self.cuda_event = handle
        self.log = log

    def record(self) -> None:
        self.log.append(self.cuda_event)


def test_called_with_a_layer_it_records_that_layers_events_in_order() -> None:
    log: list[int] = []
    records = LayerRecords({0: (Event(11, log), Event(12, log)), 1: (Event(21, log),)})
    records(0)
    records(1)
    records(2)  # a layer with no events records nothing
    assert log == [11, 12, 21]


def test_handles_are_one_flat_array_padded_to_the_widest_layer_and_kept() -> None:
    log: list[int] = []
    records = LayerRecords({0: (Event(11, log), Event(12, log)), 1: (Event(21, log),)})
    handles = records.handles(0, 2)
    assert handles is not None and handles.per_step == 2
    assert list(handles.array) == [11, 12, 21, None]
    assert ctypes.addressof(handles.array) == handles.address
    assert records.handles(0, 2) is handles  # the same array for every load of the slot
    one = records.handles(1, 2)
    assert one is not None and one.per_step == 1 and list(one.array) == [21]


def test_an_event_without_a_handle_sends_the_records_through_python() -> None:
    # torch creates a CUDA event at its first record; a simulated event has no handle at all
    log: list[int] = []
    records = LayerRecords({0: (Event(11, log),), 1: (Event(0, log),)})
    assert records.handles(0, 2) is None
    assert LayerRecords({0: (object(),)}).handles(0, 1) is None  # type: ignore[dict-item]
    assert records.handles(0, 1) is not None
