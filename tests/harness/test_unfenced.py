"""Fences that do not fence: the stream-order mutants' building block, on any device.

Stories: on the simulator a stream that waits on an ``UnfencedEvent`` runs ahead of the work
recorded before it, where the real event holds it back; on a GPU the same wrapper lets a copy
overtake a spinning stream; and because nothing in the three fence mutants names the simulator
any more, the GPU catalogue runs them instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.campaign.catalogue import is_sim_only_mutant, list_mutants
from hicache_ref.device import SimDevice, cuda_available
from hicache_ref.harness.adapters.unfenced import UnfencedDevice, UnfencedEvent

FENCE_MUTANTS = ("skip_load_fence", "skip_write_fence", "layer_backup_without_store_fence")


def _store_then_copy(device: SimDevice, event: object) -> tuple[object, object]:
    """A store queued on ``forward``, ``event`` recorded after it, a copy on ``load`` waiting on
    it; returns the two streams."""
    forward, load = device.Stream("forward"), device.Stream("load")
    with device.stream(forward):
        device.launch(lambda: None, label="store", kind="kernel")
        event.record()  # type: ignore[attr-defined]
    with device.stream(load):
        event.wait(load)  # type: ignore[attr-defined]
        device.launch(lambda: None, label="copy", kind="copy")
    return forward, load


def test_a_real_event_holds_the_copy_behind_the_store() -> None:
    device = SimDevice(seed=0)
    forward, load = _store_then_copy(device, device.Event())
    assert device.advance(load, 5) == 0  # the wait blocks: the store has not run
    device.advance(forward, 5)
    assert device.advance(load, 5) == 2  # the wait, then the copy


def test_an_unfenced_event_lets_the_copy_overtake_the_store() -> None:
    device = SimDevice(seed=0)
    event = UnfencedEvent(device.Event())
    forward, load = _store_then_copy(device, event)
    assert device.advance(load, 5) == 1  # the copy runs with the store still queued
    assert not event.query()  # the record itself still happened and is still pending
    device.advance(forward, 5)
    assert event.query()


def test_an_unfenced_device_forwards_all_but_the_wait() -> None:
    device = SimDevice(seed=0)
    unfenced = UnfencedDevice(device)
    assert isinstance(unfenced.Event(), UnfencedEvent)
    assert unfenced.current_stream() is device.current_stream()


def test_the_fence_mutants_run_on_a_gpu_catalogue() -> None:
    # they used to subclass SimEvent, so the cuda catalogue skipped them
    assert set(FENCE_MUTANTS) <= set(list_mutants())
    assert [name for name in list_mutants() if is_sim_only_mutant(name)] == []


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_an_unfenced_wait_lets_a_copy_overtake_a_spin() -> None:
    spin_cycles = 200_000_000  # ~0.1 s: far longer than the next lines on the host
    forward, load = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.full((1024,), 7.0, device="cuda")
    dst = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    results = {}
    for name, event in (
        ("unfenced", UnfencedEvent(torch.cuda.Event())),
        ("real", torch.cuda.Event()),
    ):
        dst.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(forward):
            torch.cuda._sleep(spin_cycles)  # type: ignore[no-untyped-call]
            event.record(forward)
        with torch.cuda.stream(load):
            event.wait(load)
            dst.copy_(src)
            copied = torch.cuda.Event()
            copied.record(load)
        copied.synchronize()
        results[name] = (forward.query(), dst[0].item())
        torch.cuda.synchronize()
    print(f"(forward done when the copy finished, copied value): {results}")
    assert results["unfenced"] == (False, 7.0)  # the copy finished while the spin still ran
    assert results["real"] == (True, 7.0)
