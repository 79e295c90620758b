"""Oracle traces on implementations: the storage oracle's shortest trace of a planted protocol
bug, translated to harness steps under schedule points, fails the tier that carries the bug (the
reference's mutant, upstream 0.5.23 with the bug planted) and passes the reference."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_ref.formal.bounded_storage import explore_storage
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree, fork_tree
from hicache_ref.harness.lockstep.from_storage_oracle import (
    UntranslatableStorageTrace,
    storage_trace_for,
)
from hicache_ref.harness.steps.replay import replay
from hicache_ref.oracle.storage import (
    Advance,
    OpSpec,
    Prefetch,
    StorageConfig,
    make_storage_variant,
)
from tests.harness.sglang_bugs import BUGS_0523_WINDOWS

PLANTED: dict[str, tuple[str, dict[str, object], str]] = {
    "backup_ack_before_write": (
        "backup_acks_before_write",
        {"ops": (OpSpec("backup", 1),), "pages": 1, "preloaded": (0,)},
        "INV-32",
    ),
    "io_ignores_termination": (
        "io_ignores_termination",
        {"ops": (OpSpec("prefetch", 2),), "pages": 2, "preloaded": (2,)},
        "INV-33",
    ),
}
"""Each oracle variant with a window mutant of the catalogue (and a bug of BUGS_0523_WINDOWS of
the same name), its world, and the id the translated trace fails with on the mutant."""


@pytest.fixture(autouse=True)
def quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("hicache_ref").setLevel(logging.NOTSET)


def _shortest(flag: str) -> tuple[StorageConfig, tuple[object, ...]]:
    config = StorageConfig(variant=make_storage_variant(flag), **PLANTED[flag][1])  # type: ignore[arg-type]
    result = explore_storage(config, max_depth=40)
    assert result.trace, result.summary()
    return config, result.trace


@pytest.mark.parametrize("flag", sorted(PLANTED))
def test_an_oracle_trace_fails_the_mutant_and_passes_the_reference(flag: str) -> None:
    config, ops = _shortest(flag)
    trace = storage_trace_for(config, ops)  # type: ignore[arg-type]
    mutant, _, inv_id = PLANTED[flag]
    assert replay(trace, implementation=f"mutant:{mutant}").signature() == inv_id
    assert not replay(trace).failed


@pytest.mark.parametrize("flag", ["backup_ack_before_write"])
def test_an_oracle_trace_fails_0_5_23_with_the_bug_planted(flag: str, tmp_path: Path) -> None:
    # the backup thread's points are the same in 0.5.23; its hit query asks for a whole chain in
    # one batch_exists, so a trace through the reference's per-batch queries takes other grants
    config, ops = _shortest(flag)
    trace = storage_trace_for(config, ops, implementation="sglang")  # type: ignore[arg-type]
    tree = fetch_wheel_tree("0.5.23")
    bug = next(b for b in BUGS_0523_WINDOWS if b.NAME == PLANTED[flag][0])
    target = Path(bug.TARGET)
    planted = fork_tree(bug.write_patched(tree / target, tmp_path / target.name), tree, target)
    assert replay(trace, source=str(planted)).signature() in bug.INVARIANTS
    assert not replay(trace, source=str(tree)).failed


def test_an_interleaving_the_harness_cannot_take_is_named() -> None:
    config = StorageConfig(ops=(OpSpec("prefetch", 1),), pages=1, ranks=2, preloaded=(1, 1))
    with pytest.raises(UntranslatableStorageTrace, match="one rank"):
        storage_trace_for(config, (Prefetch(0), Advance(0, 0)))
