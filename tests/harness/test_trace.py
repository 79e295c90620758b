"""Traces: versioned JSONL that round-trips exactly and replays bit-for-bit without Hypothesis."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.steps.replay import minimize, replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

STORY = (
    Step(rule="prefill", args={"tokens": 9, "early_reserve": False}),
    Step(rule="forward_layer"),
    Step(rule="forward_layer"),
    Step(rule="write", args={"node": 0}),
    Step(rule="advance", args={"stream": "write", "n": 3}),
    Step(rule="advance", args={"stream": "forward", "n": 4}),
    Step(rule="synchronize", args={"stream": "write"}),
    Step(rule="drain_acks"),
    Step(rule="evict_device", args={"node": 0}),
    Step(rule="prefill", args={"tokens": 4, "early_reserve": False}),
    Step(rule="load", args={"node": 0}),
    Step(rule="start_loading"),
    Step(rule="forward_read", args={"node": 0, "layer": 1, "draft": False}),
)


def _trace(config: HarnessConfig | None = None) -> Trace:
    return Trace(header=TraceHeader(config=config or HarnessConfig()), steps=STORY)


def _snapshot(session: Session) -> list[torch.Tensor]:
    rank = session.world.ranks[0]
    device = [
        t.clone()
        for layer in range(session.config.layer_num)
        for t in rank.device_pool.layer_buffers(layer)
    ]
    return device + [t.clone() for t in rank.host_pool.buffers.values()]


def test_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    trace = _trace()
    path = trace.write(tmp_path / "t.jsonl")
    assert Trace.read(path) == trace
    assert Trace.read(path).to_jsonl() == trace.to_jsonl()


def test_replay_is_bit_for_bit(tmp_path: Path) -> None:
    # the same trace twice -> the same outcomes, the same executed-op log, the same bytes
    runs = []
    for _ in range(2):
        session = Session(
            HarnessConfig(alloc_policy="random", seed=7), ReferenceImplementation(), "reference"
        )
        for step in STORY:
            session.apply(step)
        session.finish()
        runs.append(
            (session.outcomes, [e.label for e in session.world.device.log], _snapshot(session))
        )
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2], strict=True))


def test_replay_reports_no_failure_for_the_reference() -> None:
    result = replay(_trace())
    assert not result.failed and result.signature() == "pass"
    assert "skipped" not in result.outcomes


def test_a_trace_from_another_version_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text(_trace().to_jsonl().replace("hicache-trace/1", "hicache-trace/0", 1))
    with pytest.raises(HiCacheInputError, match="reads 'hicache-trace/1'"):
        Trace.read(path)


def test_minimize_drops_steps_that_do_not_matter() -> None:
    # a mutant failure padded with noise -> ddmin returns a trace no longer than the core
    core = Trace.read(
        Path(__file__).resolve().parents[2] / "fuzz/corpus/mutants/extra_write_ack.jsonl"
    )
    noise = [
        Step(rule="noop"),
        Step(rule="advance", args={"stream": "load", "n": 2}),
        Step(rule="noop"),
    ]
    padded = core.with_steps(tuple(noise) + core.steps + tuple(noise))
    small = minimize(padded)
    assert replay(small).failed
    assert len(small.steps) <= len(core.steps)


def test_steps_whose_precondition_fails_are_skipped_not_fatal() -> None:
    session = Session(HarnessConfig(), ReferenceImplementation(), "reference")
    assert session.apply(Step(rule="evict_host", args={"node": 42})).text == "skipped"
    assert session.stats.skipped == 1
