"""What a stepped load records after each of its layers (``LayerRecords``).

A load's layers go to the copy engine as one stepped entry (``CudaBatchCopier.issue_rows_stepped``),
and after layer ``i`` has landed the caller's stream records that layer's events: its load event
and, in a load without draft copies, the draft layer that completes with it. As a plain
callback each record is a Python call on the scheduler's thread; as ``LayerRecords`` the copier
hands the events' handles to the issuing thread's library (``CopyIssuer.wait_record``), and the
whole load's waits and records are one native call, two driver calls per layer. Called with a
layer (``records(i)``) it records the same events in Python, in the same stream order: what every
device without the issuing thread does, and the fallback while an event has no handle yet (a
CUDA event is created at its first record).

In the order a load meets it:

- ``LayerRecords(events)``: the events after each layer (``{layer: (event, ...)}``);
- ``records(layer)``: record them in Python on the current stream;
- ``handles(start, stop)``: the raw handles of layers ``start .. stop - 1`` as one array of
  ``per_step`` entries per layer (``NULL`` where a layer records fewer), or ``None`` while any
  event has no handle (not a CUDA event, or never recorded); kept once complete.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class RecordableEvent(Protocol):
    def record(self) -> Any: ...


@dataclass(frozen=True)
class StepHandles:
    """The handles of a run of layers: ``per_step`` per layer, flattened (kept alive here)."""

    array: ctypes.Array[ctypes.c_void_p]
    per_step: int
    address: int


@dataclass
class LayerRecords:
    """The events recorded after each layer of a stepped load."""

    events: Mapping[int, tuple[RecordableEvent, ...]]
    _handles: dict[tuple[int, int], StepHandles] = field(default_factory=dict)

    def __call__(self, layer: int) -> None:
        for event in self.events.get(layer, ()):
            event.record()

    def handles(self, start: int, stop: int) -> StepHandles | None:
        """The raw handles of layers ``start .. stop - 1`` (see the module doc), or ``None``."""
        kept = self._handles.get((start, stop))
        if kept is not None:
            return kept
        per_step = max((len(self.events.get(layer, ())) for layer in range(start, stop)), default=0)
        if per_step == 0:
            return None
        flat: list[int | None] = []
        for layer in range(start, stop):
            step = self.events.get(layer, ())
            for event in step:
                handle = getattr(event, "cuda_event", 0)
                if not isinstance(handle, int) or handle == 0:
                    return None  # not a CUDA event, or not created yet: records go through Python
                flat.append(handle)
            flat.extend([None] * (per_step - len(step)))
        array = (ctypes.c_void_p * len(flat))(*flat)
        handles = StepHandles(array, per_step, ctypes.addressof(array))
        self._handles[(start, stop)] = handles
        return handles
