"""CudaDevice: the real ``DeviceModule``, a thin wrapper over ``torch.cuda``.

Streams and events are torch's own objects; ``launch`` runs the closure at once, so the torch
kernels it issues are queued on the current CUDA stream, which is exactly the ordering the
controller's events describe.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import torch

from hicache_ref.device.protocol import EventT, OpKind, StreamT
from hicache_ref.errors import HiCacheInputError


def cuda_available() -> bool:
    """Whether a CUDA device can be used in this process."""
    return bool(torch.cuda.is_available())


class CudaDevice:
    """``DeviceModule`` over ``torch.cuda`` for one GPU."""

    name = "cuda"

    def __init__(self, device_index: int = 0) -> None:
        if not cuda_available():
            raise HiCacheInputError(
                "CudaDevice needs a CUDA GPU, and torch.cuda.is_available() is False "
                "(use hicache_ref.device.SimDevice on a CPU-only machine)"
            )
        if not 0 <= device_index < torch.cuda.device_count():
            raise HiCacheInputError(
                f"device_index={device_index} is outside [0, {torch.cuda.device_count()})"
            )
        self.device = torch.device("cuda", device_index)
        self.pin_memory = True
        torch.cuda.set_device(self.device)

    def Event(self, enable_timing: bool = False) -> EventT:
        return cast(EventT, torch.cuda.Event(enable_timing=enable_timing))  # type: ignore[no-untyped-call]

    def Stream(self) -> StreamT:
        return cast(StreamT, torch.cuda.Stream(device=self.device))  # type: ignore[no-untyped-call]

    def stream(self, stream: StreamT) -> AbstractContextManager[object]:
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    def current_stream(self) -> StreamT:
        return cast(StreamT, torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record_stream(self, tensor: torch.Tensor, stream: StreamT) -> None:
        if tensor.is_cuda:
            tensor.record_stream(cast(torch.cuda.Stream, stream))

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        fn()
