"""Where a storage world keeps its L3 files (on the memory-backed filesystem when it is usable),
and that no world's threads outlive it: a running storage thread keeps its world alive, so a case
that forgot to close its session is closed by ``close_open_worlds``."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path

from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.lockstep.storage_walk import walk_session, walk_step
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.storage_world import close_open_worlds, l3_parent


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
