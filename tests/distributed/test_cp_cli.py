"""``hicache-fuzz run --cp-processes N``: each bad input is one line on stderr and exit 2,
before any process is spawned; a trace says how many processes recorded it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache_ref import cli
from hicache_ref.distributed.driver import backend_of
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"


class _NoCpImplementation(ReferenceImplementation):
    name = "no_cp_for_test"
    capabilities = ReferenceImplementation.capabilities - {"cp"}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["run", *argv, "--seconds", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-fuzz: error: ")
    return err


def test_one_process_is_not_a_world_across_processes(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--cp-processes", "1"], capsys)
    assert "--cp-processes 1: a CP world across processes needs 2 to 8 ranks" in err


def test_more_ranks_than_cp_size_allows_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--cp-processes 9" in _refused(["--cp-processes", "9"], capsys)


def test_nccl_without_a_gpu_per_rank_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused(["--cp-processes", "2", "--backend", "nccl"], capsys)
    assert "--backend nccl needs one CUDA GPU per rank: 2 ranks but 0 GPU(s)" in err


def test_an_unknown_backend_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--cp-processes", "2", "--backend", "mpi"], capsys)
    assert "--backend 'mpi' is unknown; legal: gloo, nccl" in err


def test_an_implementation_without_cp_is_refused(
    capsys: pytest.CaptureFixture[str],
    name_implementation: Callable[[str, Callable[[], object]], None],
) -> None:
    name_implementation("no_cp_for_test", _NoCpImplementation)
    err = _refused(["--cp-processes", "2", "--impl", "no_cp_for_test"], capsys)
    assert "implementation 'no_cp_for_test' lacks the 'cp' capability" in err


def test_a_gpu_device_without_nccl_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--cp-processes", "2", "--device", "cuda"], capsys)
    assert "pass --backend nccl for GPUs" in err


def test_minimize_refuses_a_trace_recorded_across_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ddmin replays in one process, a world other than the one that recorded the trace
    config = HarnessConfig(pool_kind="nsa", cp_size=2, device_pages=12)
    header = TraceHeader(config=config, cp_processes=2, note="cp_processes=2 backend=gloo")
    path = Trace(header=header, steps=(Step(rule="noop"),)).write(tmp_path / "cp.jsonl")
    assert cli.main(["minimize", str(path), "-o", str(tmp_path / "small.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "was recorded across 2 processes and minimize replays in one" in err


def test_traces_without_the_field_load_as_single_process() -> None:
    # an old trace (no cp_processes in its header) replays in one process, as before
    trace = Trace.read(CORPUS / "mutants" / "drop_zero_owned_ack.jsonl")
    assert trace.header.cp_processes == 0
    assert backend_of(trace) == "gloo"
