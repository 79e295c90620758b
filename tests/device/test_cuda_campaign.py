"""Campaigns on real streams: the machines on a GPU, timing perturbed by seeded spins.

On the GPU the harness cannot choose when a copy finishes; spins queued before stream work make
the timing vary, so a missing event wait shows as wrong bytes. Three stories: a spin really
holds back the work queued behind it (the mechanism), the reference survives a short campaign
(no false alarm from real asynchrony), and a stream-order mutant is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_ref.campaign.run import run_campaign
from hicache_ref.campaign.summary import render_summary
from hicache_ref.device import cuda_available
from hicache_ref.device.cuda import cuda_campaign_device, keep_current_stream
from hicache_ref.device.perturb import Perturbation
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"),
]

SPIN_LONG_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than the host's next lines


def test_a_spin_holds_back_the_copy_queued_behind_it() -> None:
    # a copy on the load stream behind a long spin -> the forward reads without waiting: stale;
    # with the event wait: the copied bytes
    with keep_current_stream():
        device = cuda_campaign_device(0, Perturbation(probability=0.0))
        load = device.Stream()
        src = torch.full((1024,), 7.0, device=device.device)
        dst = torch.zeros(1024, device=device.device)
        done = device.Event()

        def h2d() -> None:
            dst.copy_(src, non_blocking=True)

        load.wait_stream(device.default_stream)  # src and dst are filled first
        with device.stream(load):
            device.advance(load, 1)  # probability 0: no spin from the schedule
            torch.cuda._sleep(SPIN_LONG_CYCLES)  # type: ignore[no-untyped-call]
            device.launch(h2d, label="h2d", kind="copy")
            done.record()
        unordered = dst.clone()  # forward stream, no wait
        assert not device.is_idle()
        done.wait(device.current_stream())
        ordered = dst.clone()
        device.run_until_idle()
        assert device.is_idle()
        print(f"unordered read saw {unordered[0].item()}, ordered read saw {ordered[0].item()}")
        assert unordered[0].item() == 0.0
        assert ordered[0].item() == 7.0


def test_the_reference_passes_a_short_cuda_campaign(tmp_path: Path) -> None:
    report = run_campaign(
        "reference", seconds=20.0, profile="ci", seed=0, out_dir=tmp_path, progress=False,
        device="cuda",
    )  # fmt: skip
    print(render_summary(report))
    assert report.cases > 0 and report.device == "cuda"
    assert report.failures == [], report.failures


def test_a_stream_order_mutant_is_caught_on_the_gpu(tmp_path: Path) -> None:
    # the write ack's finish event recorded on the forward stream: the ack drains while the
    # spin-delayed D2H still runs, and the drain's host byte check sees stale rows (INV-09)
    report = run_campaign(
        "mutant:write_ack_on_current_stream", seconds=90.0, profile="ci", seed=0,
        out_dir=tmp_path, progress=False, device="cuda", minimize_replays=20,
    )  # fmt: skip
    print(render_summary(report))
    assert report.failures, "the GPU campaign did not catch write_ack_on_current_stream"
    failure = report.failures[0]
    assert failure["invariant"] in ("INV-09", "INV-06", "INV-08", "INV-07"), failure
    trace = Trace.read(Path(failure["trace"]))
    assert trace.header.device == "cuda" and trace.header.perturbation is not None
    again = replay(trace)  # the same spins; real timing may still differ, so report it
    print(f"replay of {failure['trace']} ({len(trace.steps)} steps): {again.signature()}")
