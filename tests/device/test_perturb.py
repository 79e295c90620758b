"""The perturbation schedule: seeded, logged, queued where the work goes, replayed identically.

A GPU campaign cannot choose when a copy finishes, so it queues seeded spins before stream work.
These tests run on the CPU with a fake: an eager device (work runs at launch, as on CUDA, where
the closure only queues kernels) and a spin that records which stream it was queued on. The
campaign tests bind that fake under ``--device cuda``, so the whole path (campaign -> trace
header -> replay -> the same schedule) runs here without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis.errors import FlakyFailure, FlakyStrategyDefinition

from hicache_ref import cli
from hicache_ref.campaign.failures import (
    RecordedFailure,
    get_campaign_failure,
    get_failure_invariant,
    get_root_failure,
)
from hicache_ref.campaign.run import run_campaign
from hicache_ref.campaign.summary import render_summary
from hicache_ref.device import cuda_available
from hicache_ref.device.perturb import (
    DEFAULT_PERTURBATION,
    Perturbation,
    PerturbationSchedule,
    PerturbedDevice,
)
from hicache_ref.device.protocol import EventT, OpKind, StreamT
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace, TraceHeader
from hicache_ref.harness.world import world
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import gpu_config


# -- the fake: an eager device whose spins are recorded --------------------------------------------
class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = False  # what query() answers, negated

    def wait_event(self, event: EventT) -> None: ...

    def wait_stream(self, stream: StreamT) -> None: ...

    def synchronize(self) -> None:
        self.busy = False

    def query(self) -> bool:
        return not self.busy


class FakeEvent:
    def record(self, stream: StreamT | None = None) -> None: ...

    def wait(self, stream: StreamT | None = None) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class EagerDevice:
    """Runs every launch at once on the current stream, like ``CudaDevice`` (CPU tensors)."""

    name = "fake"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pin_memory = False
        self.forward = FakeStream("forward")
        self._current: StreamT = self.forward
        self.made = 0
        self.journal: list[tuple[str, str]] = []  # (stream, what): spins and launches in order

    def Event(self, enable_timing: bool = False) -> EventT:
        return FakeEvent()

    def Stream(self) -> StreamT:
        self.made += 1
        return FakeStream(f"s{self.made}")

    @contextmanager
    def stream(self, stream: StreamT) -> Iterator[object]:
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def current_stream(self) -> StreamT:
        return self._current

    def synchronize(self) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: StreamT) -> None: ...

    def launch(
        self,
        fn: object,
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        self.journal.append((_name(self._current), label))
        assert callable(fn)
        fn()

    def spin(self, cycles: int) -> None:
        self.journal.append((_name(self._current), f"spin {cycles}"))


def _name(stream: StreamT) -> str:
    assert isinstance(stream, FakeStream)
    return stream.name


def perturbed(seed: int = 7, perturbation: Perturbation = DEFAULT_PERTURBATION) -> PerturbedDevice:
    base = EagerDevice()
    return PerturbedDevice(base, PerturbationSchedule(seed, perturbation), base.spin, base.forward)


def _drive(device: PerturbedDevice) -> None:
    """A little program: forward kernels, a copy on a side stream, advances of both."""
    side = device.Stream()
    for i in range(20):
        device.launch(lambda: None, label=f"store {i}", kind="kernel")
        with device.stream(side):
            device.launch(lambda: None, label=f"h2d {i}", kind="copy")
        device.advance(side if i % 2 else device.default_stream, 3)


# -- the schedule ----------------------------------------------------------------------------------
def test_the_schedule_is_a_function_of_the_seed_and_the_parameters() -> None:
    # same seed and parameters -> the same decisions; another seed or probability -> others
    sites = [f"site {i}" for i in range(200)]
    first, again = PerturbationSchedule(3), PerturbationSchedule(3)
    assert [first.draw(s) for s in sites] == [again.draw(s) for s in sites]
    other_seed = PerturbationSchedule(4)
    other_p = PerturbationSchedule(3, Perturbation(probability=0.25))
    assert [other_seed.draw(s) for s in sites] != [d.cycles for d in first.log]
    assert [other_p.draw(s) for s in sites] != [d.cycles for d in first.log]


def test_every_decision_is_logged_in_order_with_its_site() -> None:
    schedule = PerturbationSchedule(1)
    cycles = [schedule.draw(f"site {i}") for i in range(50)]
    assert [d.index for d in schedule.log] == list(range(50))
    assert [d.site for d in schedule.log] == [f"site {i}" for i in range(50)]
    assert [d.cycles for d in schedule.log] == cycles
    assert schedule.spins() == [(d.site, d.cycles) for d in schedule.log if d.cycles]


def test_probability_zero_never_spins_and_one_always_spins_within_bounds() -> None:
    never = PerturbationSchedule(0, Perturbation(probability=0.0))
    assert all(never.draw("x") == 0 for _ in range(100))
    bounds = Perturbation(probability=1.0, cycles_min=100, cycles_max=5_000)
    always = PerturbationSchedule(0, bounds)
    drawn = [always.draw("x") for _ in range(500)]
    assert all(100 <= c <= 5_000 for c in drawn)
    # log-uniform: both short and long spins occur
    assert min(drawn) < 300 and max(drawn) > 2_000


def test_without_paces_the_default_probability_spins_at_about_half_the_sites() -> None:
    schedule = PerturbationSchedule(11, Perturbation())
    hits = sum(bool(schedule.draw("x")) for _ in range(2_000))
    assert 850 < hits < 1_150


def test_with_paces_each_stream_keeps_one_pace_for_the_whole_world() -> None:
    schedule = PerturbationSchedule(5, Perturbation(paces=True))
    roles = ["forward", "stream1", "stream2", "stream3", "stream4", "stream5"]
    spins = {role: [schedule.draw(f"{role}: kernel", role) for _ in range(400)] for role in roles}
    middle = math.sqrt(DEFAULT_PERTURBATION.cycles_min * DEFAULT_PERTURBATION.cycles_max)
    for role, cycles in spins.items():
        pace = schedule.pace(role)
        if pace == "quiet":
            assert not any(cycles), f"{role} is quiet: it never spins"
        elif pace == "slow":
            assert all(c >= middle - 1 for c in cycles), f"{role} is slow: long spins everywhere"
        else:
            assert 120 < sum(map(bool, cycles)) < 280, f"{role} spins as drawn (p=0.5)"


def test_a_streams_pace_follows_the_world_seed_and_its_role_only() -> None:
    first = PerturbationSchedule(9, Perturbation(paces=True))
    second = PerturbationSchedule(9, Perturbation(paces=True))
    second.draw("stream2: copy", "stream2")  # seen in another order
    assert first.pace("forward") == second.pace("forward")
    assert first.pace("stream2") == second.pace("stream2")
    seen = {PerturbationSchedule(seed, DEFAULT_PERTURBATION).pace("forward") for seed in range(40)}
    assert seen == {"quiet", "as drawn", "slow"}  # across worlds every pace comes up


def test_without_paces_every_stream_spins_as_drawn() -> None:
    schedule = PerturbationSchedule(5, Perturbation())
    assert {schedule.pace(role) for role in ("forward", "stream1", "stream2")} == {"as drawn"}
    assert "paces" not in Perturbation().describe() and "paces" in DEFAULT_PERTURBATION.describe()


def test_bad_parameters_are_refused_naming_the_rule() -> None:
    with pytest.raises(ValueError, match="probability"):
        Perturbation(probability=1.5)
    with pytest.raises(ValueError, match="cycles_min <= cycles_max"):
        Perturbation(cycles_min=10, cycles_max=5)


# -- the perturbed device --------------------------------------------------------------------------
def test_a_spin_is_queued_on_the_launching_stream_right_before_the_work() -> None:
    device = perturbed(perturbation=Perturbation(probability=1.0))
    base = device.base
    assert isinstance(base, EagerDevice)
    side = device.Stream()
    # forward kernel -> spin on forward, then the kernel; copy on the side stream -> same there
    device.launch(lambda: None, label="store n0 L0", kind="kernel")
    with device.stream(side):
        device.launch(lambda: None, label="h2d layer 0", kind="copy")
    streams = [stream for stream, _ in base.journal]
    whats = [what.split()[0] for _, what in base.journal]
    assert streams == ["forward", "forward", "s1", "s1"]
    assert whats == ["spin", "store", "spin", "h2d"]
    assert [d.site for d in device.schedule.log] == [
        "forward: kernel store n0 L0",
        "stream1: copy h2d layer 0",
    ]


def test_host_bookkeeping_launches_are_not_perturbed() -> None:
    device = perturbed(perturbation=Perturbation(probability=1.0))
    device.launch(lambda: None, label="ack", kind="host")
    assert device.schedule.log == []


def test_advance_spins_on_the_named_stream_and_runs_nothing() -> None:
    device = perturbed(perturbation=Perturbation(probability=1.0))
    base = device.base
    assert isinstance(base, EagerDevice)
    side = device.Stream()
    assert device.advance(side, 5) == 0  # a real stream runs by itself
    assert base.journal[0][0] == "s1" and base.journal[0][1].startswith("spin")
    assert device.current_stream() is base.forward  # the stream context was left again


def test_is_idle_asks_every_stream_of_the_world() -> None:
    device = perturbed()
    side = device.Stream()
    assert device.is_idle()
    assert isinstance(side, FakeStream)
    side.busy = True
    assert not device.is_idle()
    side.synchronize()
    assert device.is_idle()


def test_the_same_program_gets_the_same_spins_on_a_rebuilt_device() -> None:
    # run -> rebuild with the same seed -> identical spins in identical places
    first, again, other = perturbed(5), perturbed(5), perturbed(6)
    for device in (first, again, other):
        _drive(device)
    assert first.schedule.log == again.schedule.log
    assert [d.cycles for d in first.schedule.log] != [d.cycles for d in other.schedule.log]
    assert first.base.journal == again.base.journal  # type: ignore[attr-defined]


# -- campaigns on the fake, bound where --device cuda binds the GPU ---------------------------------
@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[PerturbedDevice]:
    """Bind the eager fake under ``cuda``; every world's device is appended to the list."""
    made: list[PerturbedDevice] = []

    @contextmanager
    def binding(perturbation: Perturbation) -> Iterator[world.DeviceFactory | None]:
        def factory(config: HarnessConfig) -> PerturbedDevice:
            device = perturbed(config.seed, perturbation)
            made.append(device)
            return device

        yield factory

    monkeypatch.setitem(world.DEVICE_BINDINGS, "cuda", binding)
    return made


def test_the_reference_passes_a_cuda_campaign_on_an_eager_device(
    fake_cuda: list[PerturbedDevice], tmp_path: Path
) -> None:
    report = run_campaign(
        "reference", seconds=2.0, profile="ci", seed=0, out_dir=tmp_path, progress=False,
        device="cuda",
    )  # fmt: skip
    assert report.failures == [] and report.cases > 0
    assert report.device == "cuda" and report.perturbation == DEFAULT_PERTURBATION
    assert report.as_json()["device"] == "cuda"
    assert "cuda (perturbed, p=0.5" in render_summary(report)
    assert fake_cuda and any(d.schedule.spins() for d in fake_cuda)
    # a GPU world: run-merged copies, records complete with their stream, no misuse probes
    assert not any(rule.startswith("probe_") for rule in report.rules)


def test_a_cuda_failure_trace_records_the_device_and_replays_the_same_schedule(
    fake_cuda: list[PerturbedDevice], tmp_path: Path
) -> None:
    # a mutant caught on any schedule -> its trace says cuda -> two replays draw the same spins
    report = run_campaign(
        "mutant:extra_write_ack", seconds=20.0, profile="ci", seed=0, out_dir=tmp_path,
        progress=False, device="cuda", minimize_replays=40,
    )  # fmt: skip
    assert report.failures, "extra_write_ack is caught on every device"
    trace = Trace.read(Path(report.failures[0]["trace"]))
    assert trace.header.device == "cuda"
    assert trace.header.perturbation == DEFAULT_PERTURBATION
    assert trace.header.config.copy_path == "runs"
    fake_cuda.clear()
    first, second = replay(trace), replay(trace)
    assert first.failed and first.signature() == second.signature() == "INV-02"
    assert len(fake_cuda) == 2
    assert fake_cuda[0].schedule.log == fake_cuda[1].schedule.log
    # the same trace on the simulator builds a SimDevice (no perturbed device)
    fake_cuda.clear()
    assert replay(trace, device="sim").signature() == "INV-02"
    assert fake_cuda == []


def test_on_device_narrows_an_implementation_to_what_a_gpu_runs() -> None:
    reference = get_implementation("reference")
    assert world.on_device(reference, "sim") is reference
    gpu = world.on_device(reference, "cuda")
    assert "guards" in reference.capabilities and "guards" not in gpu.capabilities
    refine = getattr(gpu, "refine_config")  # noqa: B009
    refined = refine(HarnessConfig(copy_path="gather", settle_records=False))
    assert refined.copy_path == "runs" and refined.settle_records


def test_an_old_trace_header_loads_as_a_sim_trace() -> None:
    header = TraceHeader.model_validate({"config": HarnessConfig().model_dump()})
    assert header.device == "sim" and header.perturbation is None


def test_an_unknown_device_is_refused_naming_the_legal_ones() -> None:
    with pytest.raises(ValueError, match="legal: sim, cuda"):
        world.check_device_kind("tpu")


@pytest.mark.skipif(cuda_available(), reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--device", "cuda", "--seconds", "1"],
        ["gate", "--device", "cuda", "--budget", "1"],
        ["mutants", "write_ack_on_current_stream", "--device", "cuda", "--seconds", "1"],
        ["replay", "CUDA_TRACE"],
    ],
)
def test_cuda_without_a_gpu_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = TraceHeader(config=HarnessConfig(copy_path="runs"), device="cuda")
    cuda_trace = Trace(header=header, steps=()).write(tmp_path / "cuda.jsonl")
    argv = [str(cuda_trace) if a == "CUDA_TRACE" else a for a in argv]
    out = [] if argv[0] == "replay" else ["--out", str(tmp_path)]
    assert cli.main([*argv, *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0] and "--device sim" in err[0]


def test_a_cuda_trace_replays_on_the_simulator_when_asked(tmp_path: Path) -> None:
    header = TraceHeader(config=HarnessConfig(copy_path="runs"), device="cuda")
    cuda_trace = Trace(header=header, steps=()).write(tmp_path / "cuda.jsonl")
    assert cli.main(["replay", str(cuda_trace), "--device", "sim"]) == 0


# -- what a round reports when a real device's timing makes Hypothesis' re-run differ --------------
def test_a_flaky_failure_reports_the_violation_inside_it() -> None:
    # FlakyFailure wraps the first run's error: the campaign records that error's invariant
    violation = InvariantViolation("INV-09", "write ack drained: host copy of node 0 stale")
    flaky = FlakyFailure("Inconsistent results", [violation])
    assert get_root_failure(flaky) is violation
    assert get_failure_invariant(get_root_failure(flaky)) == "INV-09"


def test_a_flaky_rerun_without_inner_errors_reports_the_recorded_trace(tmp_path: Path) -> None:
    # a Flaky error with nothing inside -> the last failing trace's note names the invariant
    header = TraceHeader(config=HarnessConfig(), note="InvariantViolation: INV-11 violated: read")
    path = Trace(header=header, steps=()).write(tmp_path / "failure.jsonl")
    found = get_campaign_failure(FlakyStrategyDefinition("Inconsistent data generation"), path)
    assert isinstance(found, RecordedFailure)
    assert get_failure_invariant(found) == "INV-11"


def test_a_gpu_world_runs_the_simulators_gather_as_runs_or_the_triton_kernel() -> None:
    # gather is CPU-only: on a GPU it becomes runs for even seeds and triton for odd ones (where
    # Triton is installed), decided by the config alone so a replay decides the same
    even, odd = HarnessConfig(seed=4), HarnessConfig(seed=5)
    assert gpu_config(even, triton=True).copy_path == "runs"
    assert gpu_config(odd, triton=True).copy_path == "triton"
    assert gpu_config(odd, triton=False).copy_path == "runs"
    drawn_batch = HarnessConfig(seed=5, copy_path="batch")
    assert gpu_config(drawn_batch, triton=True).copy_path == "batch"
    assert gpu_config(odd, triton=True).settle_records
