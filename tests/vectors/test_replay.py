"""Replay: the reference passes every shipped vector; a divergence is named like a harness
failure (invariant id, step, expected vs got); the command's closing line and exit codes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from hicache_ref.cli import main
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.vectors.replay import replay_vector, replay_vectors, skip_reason
from tests.vectors.conftest import shipped


@pytest.fixture(scope="module")
def vectors() -> list:  # type: ignore[type-arg]
    return shipped()[1]


def by_id(vectors: list, vector_id: str):  # type: ignore[no-untyped-def,type-arg]
    return next(v for v in vectors if v.id == vector_id)


def test_the_reference_passes_every_shipped_vector(vectors: list) -> None:  # type: ignore[type-arg]
    report = replay_vectors(vectors, get_implementation("reference"), "reference")
    assert report.count("fail") == 0, [r.render() for r in report.results if r.status == "fail"]
    assert report.count("pass") == len(vectors)


def test_a_harness_check_names_its_invariant_and_step(vectors: list) -> None:  # type: ignore[type-arg]
    # write n0 -> a mutant appends a second ack for it -> INV-02 fires at that write
    vector = by_id(vectors, "story-inv02-one-ack-per-write")
    result = replay_vector(vector, get_implementation("mutant:extra_write_ack"), "mutant")
    assert (result.status, result.invariant, result.op) == ("fail", "INV-02", "write(node=0)")
    assert result.render().startswith(f"FAIL {vector.id}: INV-02 at step 6 (write(node=0)): ")


def test_a_vector_that_fails_leaves_no_thread_of_its_world_behind(vectors: list) -> None:  # type: ignore[type-arg]
    # the mutant acks a backup before its write: INV-32 fails mid-vector, with the gated storage
    # threads parked and the lockstep threads alive; the replay closes the world all the same
    vector = by_id(vectors, "story-inv32-an-acked-backup-is-in-l3-at-the-drain")
    before = set(threading.enumerate())
    result = replay_vector(vector, get_implementation("mutant:backup_acks_before_write"), "m")
    assert (result.status, result.invariant) == ("fail", "INV-32")
    deadline = time.monotonic() + 5.0
    while (left := [t.name for t in threading.enumerate() if t not in before]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert left == []


def test_a_differing_observation_names_the_field_expected_and_got(vectors: list) -> None:  # type: ignore[type-arg]
    # the write ack's finish event on the forward stream: after the write stream ran dry
    # the ack is still unfinished, so the drain pops nothing where one row was expected
    vector = by_id(vectors, "story-inv01-whole-pages")
    result = replay_vector(vector, get_implementation("mutant:write_ack_on_current_stream"), "m")
    assert (result.status, result.invariant, result.what) == ("fail", "INV-09", "drained.write")
    assert result.render().endswith("drained.write expected [[0]], got []")


def test_vectors_beyond_the_capabilities_are_skipped_with_the_reason(vectors: list) -> None:  # type: ignore[type-arg]
    sglang = get_implementation("sglang")
    probe = by_id(vectors, "story-inv07-evict-host-before-ack")
    assert skip_reason(probe, sglang, "sim") == "needs guards"
    ops = next(v for v in vectors if v.schedule == "ops")
    assert "schedule ops" in (skip_reason(ops, sglang, "sim") or "")
    sim_only = next(v for v in vectors if v.schedule == "sim")
    assert "simulated device only" in (
        skip_reason(sim_only, get_implementation("reference"), "cuda") or ""
    )


def test_the_command_prints_a_line_per_vector_and_the_closing_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only = ["story-inv01-whole-pages", "story-inv09-drain-only-finished"]
    report = tmp_path / "report.json"
    assert main(["vectors", "replay", "--only", *only, "--json", str(report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"PASS {only[0]}", f"PASS {only[1]}", "2 vectors, 2 passed, 0 failed"]
    assert json.loads(report.read_text())["passed"] == 2
    assert main(["vectors", "replay", "--impl", "mutant:extra_write_ack", "--only", *only]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 vectors, 0 passed, 2 failed"


def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vectors", "replay", "--only", "no-such-vector"]) == 2
    assert main(["vectors", "replay", "--impl", "no.such.module:factory"]) == 2
    assert main(["vectors", "replay", "--impl", "nonsense"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3
    assert "no vector 'no-such-vector'" in errors[0]
    assert "cannot import module 'no.such.module'" in errors[1]
    assert "unknown implementation 'nonsense'" in errors[2]


@pytest.mark.cuda
def test_the_reference_passes_the_vectors_a_gpu_can_replay(vectors: list) -> None:  # type: ignore[type-arg]
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    report = replay_vectors(vectors, get_implementation("reference"), "reference", "cuda")
    assert report.count("fail") == 0, [r.render() for r in report.results if r.status == "fail"]
    assert report.count("pass") > 200


@pytest.fixture
def eager_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bind the eager fake GPU (every op runs at once) where ``--device cuda`` binds the GPU."""
    from contextlib import contextmanager

    from hicache_ref.harness.world import world
    from tests.device.test_perturb import perturbed

    @contextmanager
    def binding(perturbation):  # type: ignore[no-untyped-def]
        yield lambda config: perturbed(config.seed, perturbation)

    monkeypatch.setitem(world.DEVICE_BINDINGS, "cuda", binding)


def test_vectors_of_schedule_any_pass_where_every_copy_runs_at_once(
    vectors: list,  # type: ignore[type-arg]
    eager_cuda: None,
) -> None:
    # a GPU-like device that finishes every op when it is issued: an `any` vector's answers
    # must not depend on work not having run, so the reference passes them all there too
    sample = [v for v in vectors if v.schedule == "any"][::6]
    report = replay_vectors(sample, get_implementation("reference"), "reference", "cuda")
    assert report.count("fail") == 0, [r.render() for r in report.results if r.status == "fail"]
    assert report.count("pass") > len(sample) // 2
