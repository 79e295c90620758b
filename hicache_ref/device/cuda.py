"""CudaDevice: the real ``DeviceModule``, a thin wrapper over ``torch.cuda``.

Streams and events are torch's own objects; ``launch`` runs the closure at once, so the torch
kernels it issues are queued on the current CUDA stream, which is exactly the ordering the
controller's events describe.

``cuda_campaign_device`` is what a harness campaign runs on: a ``PerturbedDevice``
(``device/perturb.py``) over ``CudaDevice`` with its own forward stream and seeded
``torch.cuda._sleep`` spins before stream work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import cast

import torch

from hicache_ref.device.perturb import (
    DEFAULT_PERTURBATION,
    Perturbation,
    PerturbationSchedule,
    PerturbedDevice,
)
from hicache_ref.device.protocol import EventT, OpKind, StreamT
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError


def cuda_available() -> bool:
    """Whether a CUDA device can be used in this process."""
    return bool(torch.cuda.is_available())


def require_cuda(what: str = "--device cuda") -> None:
    """Raise a one-line ``HiCacheSetupError`` unless a CUDA GPU can be used here."""
    if not cuda_available():
        raise HiCacheSetupError(
            f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); run on a GPU machine, or use --device sim"
        )


class CudaDevice:
    """``DeviceModule`` over ``torch.cuda`` for one GPU."""

    name = "cuda"
    launches_directly = True
    """``launch`` runs its work at once with nothing queued around it, so one launch of several
    layers is their launches back to back (``HostKVCache.load_to_device_layers`` relies on it;
    the simulator queues a launch, a perturbed device spins before each)."""

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


def spin_current_stream(cycles: int) -> None:
    """Queue a kernel that spins ``cycles`` GPU clock cycles on the current stream."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def cuda_campaign_device(
    seed: int, perturbation: Perturbation = DEFAULT_PERTURBATION, device_index: int = 0
) -> PerturbedDevice:
    """A fresh campaign device on one GPU: a forward stream of its own, made torch's current
    stream (as sglang's scheduler runs the forward on its own stream), and seeded spins.

    It first waits for the GPU to go idle: a case that failed mid-way leaves copies queued on
    its streams, and the caching allocator may hand their freed pool memory to this world."""
    base = CudaDevice(device_index)
    base.synchronize()
    forward = base.Stream()
    torch.cuda.set_stream(cast(torch.cuda.Stream, forward))
    schedule = PerturbationSchedule(seed, perturbation)
    return PerturbedDevice(base, schedule, spin_current_stream, forward)


@contextmanager
def keep_current_stream() -> Iterator[None]:
    """Restore torch's current CUDA stream on exit (campaign devices replace it per world)."""
    previous = torch.cuda.current_stream()
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
