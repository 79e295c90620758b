"""Fences that do not fence: the building block of the stream-order mutants, on any device.

A stream-order bug of the kind that ships (a copy stream that never waits for the forward
stream's store, sglang#36738, sglang#38463, vLLM#45704) is an event recorded but never waited
on. ``UnfencedEvent`` wraps an event from the device's own ``Event()`` (a ``SimEvent`` on the
simulator, a ``torch.cuda.Event`` on a GPU, or whatever a perturbing device hands out) and
forwards everything to it except ``wait``, which does nothing. ``UnfencedDevice`` forwards a
device module but hands out such events, so a mutant can wrap one controller method in it.

Nothing here names the simulator: the same mutant runs on ``SimDevice`` and on ``CudaDevice``,
where the campaign's perturbation (spin kernels on the streams) opens the window the missing
wait leaves.
"""

from __future__ import annotations

from typing import Any


class UnfencedEvent:
    """The device's event, whose ``wait`` is dropped (record, query, synchronize pass on)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def record(self, stream: Any = None) -> None:
        self.inner.record(stream)

    def wait(self, stream: Any = None) -> None:
        return  # MUTATION: the waiting stream is not ordered after the recorded work

    def query(self) -> bool:
        return bool(self.inner.query())

    def synchronize(self) -> None:
        self.inner.synchronize()

    def elapsed_time(self, end_event: Any) -> float:
        end = end_event.inner if isinstance(end_event, UnfencedEvent) else end_event
        return float(self.inner.elapsed_time(end))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class UnfencedDevice:
    """A device module whose ``Event()`` returns ``UnfencedEvent``; everything else forwards."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def Event(self, enable_timing: bool = False) -> UnfencedEvent:
        return UnfencedEvent(self.inner.Event(enable_timing=enable_timing))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
