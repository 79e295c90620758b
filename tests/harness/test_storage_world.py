"""Where a storage world keeps its L3 files (on the memory-backed filesystem when it is usable),
and that no world's threads outlive it: a running storage thread keeps its world alive, so a case
that forgot to close its session is closed by ``close_open_worlds``."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hicache_ref.campaign.run import run_campaign
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.lockstep.storage_walk import walk_session, walk_step
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.storage_world import close_open_worlds, l3_parent
from hicache_ref.vectors.stories import STORIES
from hicache_ref.vectors.storybook import record_story

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "mutants"


def test_the_l3_directory_goes_to_a_usable_memory_filesystem(tmp_path: Path) -> None:
    assert l3_parent(tmp_path) == tmp_path


def test_without_a_memory_filesystem_the_l3_directory_goes_to_the_default_temp_dir(
    tmp_path: Path,
) -> None:
    assert l3_parent(tmp_path / "missing") is None
    (tmp_path / "a-file").write_text("not a directory")
    assert l3_parent(tmp_path / "a-file") is None


def test_a_file_backed_world_keeps_its_l3_where_l3_parent_says() -> None:
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_backend="file")
    session = Session(config, ReferenceImplementation(), "reference")
    storage = session.storage
    assert storage is not None
    expected = l3_parent() or Path(tempfile.gettempdir())
    assert storage.l3.root.parent.parent == expected
    assert storage.l3.root.parent.name.startswith("hicache-l3-")
    session.close()


def threads_started_since(before: set[threading.Thread], wait_s: float = 0.0) -> list[str]:
    """The threads alive now that were not before (waiting up to ``wait_s`` for them to end)."""
    deadline = time.monotonic() + wait_s
    while True:
        new = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.01)


def test_a_world_its_case_forgot_to_close_is_closed_by_close_open_worlds() -> None:
    before = set(threading.enumerate())
    session = walk_session(ReferenceImplementation(), "reference", seed=3, points=True)
    rng = random.Random(3)
    started: list[str] = []
    while not any(name.startswith("hicache-storage") for name in started):  # attached: parked
        session.apply(walk_step(session, rng))
        started = threads_started_since(before)
    del session  # forgotten, not closed: its threads keep its world alive
    assert close_open_worlds() >= 1
    assert threads_started_since(before, wait_s=5.0) == []
    assert close_open_worlds() == 0  # closed once, and no longer listed


def test_a_closed_session_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    with walk_session(ReferenceImplementation(), "reference", seed=3, points=True) as session:
        session.apply(walk_step(session, random.Random(3)))
        assert threads_started_since(before)  # attached: the gated threads park
    assert threads_started_since(before, wait_s=5.0) == []
    assert close_open_worlds() == 0


def _replay_a_failing_trace(tmp_path: Path) -> None:
    # the mutant acks a backup before its write; its minimal trace runs under schedule points
    assert replay(Trace.read(CORPUS / "backup_acks_before_write.jsonl")).failed


def _run_a_campaign_to_its_first_failure(tmp_path: Path) -> None:
    report = run_campaign(
        "mutant:backup_acks_before_write", seconds=300, cases_max=40, profile="ci", seed=0,
        out_dir=tmp_path, progress=False, shrink=False,
    )  # fmt: skip
    assert report.failures


def _record_a_storage_story(tmp_path: Path) -> None:
    story = next(s for s in STORIES if s.id == "story-inv32-an-acked-backup-is-in-l3-at-the-drain")
    record_story(story).vector()


@pytest.mark.parametrize(
    "entry",
    [_replay_a_failing_trace, _run_a_campaign_to_its_first_failure, _record_a_storage_story],
    ids=["trace-replay", "campaign", "vector-recording"],
)
def test_the_package_closes_every_world_it_builds(
    entry: Callable[[Path], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # storage threads start inside the entry point; none is left when it returns (the suite's
    # own clean-up, close_open_worlds, runs only after the test)
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread, *args: Any, **kwargs: Any) -> None:
        started.append(thread.name)
        start(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", counted)
    before = set(threading.enumerate())
    entry(tmp_path)
    assert any(name.startswith(("hicache-storage", "lockstep")) for name in started), started
    assert threads_started_since(before, wait_s=5.0) == []
