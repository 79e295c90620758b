"""Forward reads checked once they have run, so a read never drains the forward stream.

Stories: a read queued behind unfinished work stays pending, and is compared once that work
has run; a read that saw the wrong bytes fails when it is compared, naming INV-11 and the
read; ``collect(wait=True)`` compares every read still pending (quiescence). On a GPU the same
holds with a spin on the forward stream: the host returns from the read (and from uploading a
store's rows) while the spin still runs, where the old host-side comparison waited for it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from hicache_ref.device import CudaDevice, SimDevice, cuda_available
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.driver.byte_checks import ByteChecks, DeferredReads
from hicache_ref.invariants.registry import CheckRunner

ROWS = torch.arange(1.0, 9.0).reshape(4, 2)  # oracle rows are never 0


def _checks(device: Any, forward: Any = None) -> tuple[DeferredReads, ByteChecks]:
    stream = forward if forward is not None else device.default_stream
    world = cast(Any, SimpleNamespace(device=device, forward_stream=stream))
    bytes_ = ByteChecks(world, cast(Any, None), CheckRunner())
    return DeferredReads(world, bytes_), bytes_


def test_a_read_behind_unfinished_work_is_compared_once_that_work_has_run() -> None:
    device = SimDevice(seed=0)
    reads, bytes_ = _checks(device)
    forward = device.Stream("forward")
    with device.stream(forward):
        device.launch(lambda: None, label="spin", kind="kernel")  # has not run
        reads.defer(ROWS.clone(), ROWS, "forward read of node 1 target layer 0 component 0")
    reads.collect()
    assert len(reads.pending) == 1 and bytes_.checks.counts["INV-11"] == 0  # still behind the work
    device.advance(forward, 5)
    reads.collect()
    assert reads.pending == [] and bytes_.checks.counts["INV-11"] == 1


def test_a_read_that_saw_the_wrong_bytes_fails_when_compared() -> None:
    device = SimDevice(seed=0)
    reads, _ = _checks(device)
    reads.defer(torch.zeros_like(ROWS), ROWS, "forward read of node 3 draft layer 1 component 0")
    device.run_until_idle()  # the read has run
    with pytest.raises(InvariantViolation) as failure:
        reads.collect()
    assert failure.value.inv_id == "INV-11"
    assert "forward read of node 3 draft layer 1" in str(failure.value)


def test_at_quiescence_every_pending_read_is_compared() -> None:
    device = SimDevice(seed=0)
    reads, bytes_ = _checks(device)
    with device.stream(device.Stream("forward")):
        device.launch(lambda: None, label="spin", kind="kernel")
        for _ in range(3):
            reads.defer(ROWS.clone(), ROWS, "forward read")
    device.run_until_idle()  # what finish() does before it collects
    reads.collect(wait=True)
    assert reads.pending == [] and bytes_.checks.counts["INV-11"] == 3


SPIN_CYCLES = 400_000_000  # ~0.2 s on an H200: far longer than the host's next lines


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_read_and_an_upload_leave_the_forward_stream_running() -> None:
    device = CudaDevice()
    forward = torch.cuda.Stream()
    reads, bytes_ = _checks(device, forward)
    buf = torch.zeros(16, 2, device="cuda")
    locs = torch.tensor([3, 5, 7, 9], device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
        staged = bytes_._upload(ROWS, buf.device)  # a store's payload
        buf[locs] = staged  # the store, queued behind the spin
        reads.defer(buf[locs], ROWS, "forward read of node 1 target layer 0 component 0")
        reads.collect()
        running = not forward.query()
    assert running, "the upload, the store or the read waited for the spin"
    assert bytes_.checks.counts["INV-11"] == 0  # the read has not run yet: nothing compared
    reads.collect(wait=True)
    assert bytes_.checks.counts["INV-11"] == 1  # compared once it ran, and it saw the store's rows
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
        buf[locs] = 0.5  # a stale store lands before the read
        reads.defer(buf[locs], ROWS, "forward read of node 2 target layer 0 component 0")
    with pytest.raises(InvariantViolation, match="forward read of node 2"):
        reads.collect(wait=True)
