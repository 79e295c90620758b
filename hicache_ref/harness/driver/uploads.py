"""Host tensors onto the GPU without making the host wait for the stream that will use them.

A pageable host-to-device copy on a stream makes the host wait until that stream reaches the
copy: uploaded on the forward stream, a harness tensor (a store's payload, a node's device
locs) would drain everything queued there, and close the very windows a GPU campaign's spins
open. ``SideUploads.upload`` copies on a side stream of its own (the host waits for that copy
only), makes the current and the forward stream wait for it on the device (a node's locs are
kept and read later on either), and marks the memory used by both, so the caching allocator
never hands it out while a kernel queued on either still reads it.
"""

from __future__ import annotations

import torch

from hicache_ref.device.protocol import StreamT
from hicache_ref.harness.world.world import World


class SideUploads:
    """One world's uploads, on one side stream made on first use."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._side: StreamT | None = None

    def upload(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``rows`` on ``device``, usable on the current stream once this returns.

        The memory is allocated on the side stream, where it is written, then marked used by
        the current and the forward stream: allocated on the current stream, the allocator
        could hand out a block a kernel still queued there reads (a freed index tensor, say),
        and the side stream's write would race it. Seen on an H200 under 16 processes as an
        index kernel's out-of-bounds assert; CUDA's stream sanitizer
        (``TORCH_CUDA_SANITIZER=1``) names it."""
        module = self.world.device
        current = module.current_stream()
        uploaded = module.Event()
        with module.stream(self._side_stream()):
            staged = torch.empty(rows.shape, dtype=rows.dtype, device=device)
            staged.copy_(rows)
            uploaded.record()
        forward = self.world.forward_stream
        current.wait_event(uploaded)
        if forward != current:
            forward.wait_event(uploaded)
        module.record_stream(staged, current)
        module.record_stream(staged, forward)
        return staged

    def _side_stream(self) -> StreamT:
        if self._side is None:
            self._side = self.world.device.Stream()
        return self._side
