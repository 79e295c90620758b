"""The device of a CP rank on a GPU (``--backend nccl``): ``CudaDevice`` as a harness device.

The simulator decides when queued work runs; a GPU decides itself. So ``advance`` is a timing
perturbation (the host waits for that stream, which lets the others race ahead), and
``run_until_idle`` is a device synchronize. A GPU case is not replayed bit for bit: the drains
see whatever completed, and the ranks agree on MIN(ready) as they do on the simulator.
"""

from __future__ import annotations

from hicache_ref.device.cuda import CudaDevice
from hicache_ref.device.protocol import StreamT


class CudaRankDevice(CudaDevice):
    """One GPU per rank (``cuda:<rank>``), with the simulator's scheduling surface."""

    def __init__(self, device_index: int) -> None:
        super().__init__(device_index)
        self._streams: list[StreamT] = []

    @property
    def default_stream(self) -> StreamT:
        return self.current_stream()

    def Stream(self) -> StreamT:
        stream = super().Stream()
        self._streams.append(stream)
        return stream

    def advance(self, stream: StreamT, n: int = 1) -> int:
        stream.synchronize()
        return 0  # a GPU does not say how many kernels ran

    def advance_to_record(self, stream: StreamT) -> int:
        return self.advance(stream)  # a real stream reaches its records by itself

    def is_idle(self) -> bool:
        return all(s.query() for s in [self.default_stream, *self._streams])

    def run_until_idle(self) -> None:
        self.synchronize()
