"""What the controller needs from ``torch.cuda``: streams, events, and a place to run work.

The controller and the pools never touch ``torch.cuda`` directly; they hold a ``DeviceModule``.
``CudaDevice`` (``device/cuda.py``) forwards to torch.cuda; ``SimDevice`` (``device/sim.py``)
queues every operation on a FIFO per stream and runs nothing until the test advances a stream.

The one addition to torch.cuda's surface is ``launch(fn, label=...)``: every piece of stream work
(a copy, a KV store, a read) is a closure handed to ``launch``. On CUDA the closure runs at once
and its torch kernels are queued on the current stream; on the simulator the closure itself is
queued and runs when the stream is advanced, so the bytes move exactly when the stream says so.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal, Protocol, runtime_checkable

import torch

OpKind = Literal["copy", "kernel", "record", "wait", "host"]
"""What a queued stream operation is: a transfer, a compute kernel (KV store or read), an event
record, an event wait, or host-side bookkeeping that must run in stream order."""


@runtime_checkable
class Stream(Protocol):
    """A FIFO of device work (``torch.cuda.Stream``)."""

    def wait_event(self, event: Event) -> None: ...

    def wait_stream(self, stream: Stream) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@runtime_checkable
class Event(Protocol):
    """A marker in a stream (``torch.cuda.Event``).

    CUDA semantics that the simulator reproduces exactly:
    - ``query()`` on a never-recorded event is True;
    - ``wait`` binds to the most recent ``record`` at the time of the ``wait`` call;
      recording again later affects only later waits.
    """

    def record(self, stream: Stream | None = None) -> None: ...

    def wait(self, stream: Stream | None = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


StreamT = Stream
EventT = Event


class DeviceModule(Protocol):
    """The seam: everything the controller and pools ask of the accelerator."""

    name: str
    """``"cuda"`` or ``"sim"``."""

    device: torch.device
    """Where device KV pools are allocated."""

    pin_memory: bool
    """Whether host pools should be pinned (only on a real GPU)."""

    def Event(self, enable_timing: bool = False) -> EventT: ...

    def Stream(self) -> StreamT: ...

    def stream(self, stream: StreamT) -> AbstractContextManager[object]: ...

    def current_stream(self) -> StreamT: ...

    def synchronize(self) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: StreamT) -> None: ...

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        """Run ``fn`` as stream work on the current stream (see the module docstring).

        ``meta`` describes the work for observers (the simulator's log and the harness): for a
        copy, its direction, layer and the host/device indices it moves.
        """
        ...
