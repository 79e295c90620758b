"""Where a storage world keeps its L3 files: on the memory-backed filesystem when it is usable."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.storage_world import l3_parent


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
