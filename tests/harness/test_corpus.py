"""Minimal traces of real findings, replayed forever.

fuzz/corpus/*.jsonl: findings against the reference or the harness (a false alarm on an
upstream release replays on that release; each note says what was found and fixed); they must
pass now. fuzz/corpus/mutants/<name>.jsonl: each mutant's minimal failing program; it
must still fail on that mutant with an invariant violation and pass on the reference. On a GPU
every one of these simulator programs replays on the reference as a GPU campaign would draw it,
and passes: a failure there is a false alarm of the GPU harness.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.device import cuda_available
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"
FINDINGS = sorted(CORPUS.glob("*.jsonl"))
MUTANT_TRACES = sorted((CORPUS / "mutants").glob("*.jsonl"))


def test_corpus_is_present() -> None:
    assert FINDINGS and MUTANT_TRACES


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_finding_stays_fixed(path: Path) -> None:
    trace = Trace.read(path)
    assert trace.header.note, "every corpus trace says what it found"
    result = replay(trace)
    assert not result.failed, f"{path.name} regressed: {result.error}"


@pytest.mark.parametrize("path", MUTANT_TRACES, ids=lambda p: p.stem)
def test_mutant_trace_still_fails_on_its_mutant(path: Path) -> None:
    trace = Trace.read(path)
    assert trace.header.implementation == f"mutant:{path.stem}"
    on_mutant = replay(trace)
    assert on_mutant.failed and on_mutant.signature().startswith("INV-"), on_mutant.error
    assert not replay(trace, implementation="reference").failed


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", FINDINGS + MUTANT_TRACES, ids=lambda p: p.stem)
def test_every_corpus_program_passes_on_the_reference_on_a_gpu(path: Path) -> None:
    trace = Trace.read(path)
    assert trace.header.device == "sim"  # recorded on the simulator, often with copy_path gather
    result = replay(trace, implementation="reference", device="cuda")
    assert not result.failed, f"{path.name} on a GPU: {result.error}"
