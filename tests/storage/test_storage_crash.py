"""A writer killed in the middle of a page write leaves no page that reads back as valid.

The file backend writes a page into a temporary file and renames it into place (INV-30). A
child process writes a large page, chunk by chunk, and is killed with SIGKILL while the bytes
are still going out; the page must then be absent (not torn), a later write must succeed, and
``clear`` must remove the orphaned temporary file of its own namespace only.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from hicache_ref.storage.backend import HiCacheStorageConfig
from hicache_ref.storage.file_backend import TEMP_FILE_SUFFIX, FileStorage

PAGE_NUMEL = 1 << 20  # 4 MiB of float32: four chunks
WRITER = textwrap.dedent(
    """
    import sys, time
    import torch
    from hicache_ref.storage.backend import HiCacheStorageConfig
    from hicache_ref.storage import file_backend

    def slow_write(self, tmp_file, data):
        for start in range(0, len(data), file_backend.WRITE_CHUNK_BYTES):
            tmp_file.write(data[start : start + file_backend.WRITE_CHUNK_BYTES])
            tmp_file.flush()
            print("chunk", flush=True)
            time.sleep(30)  # the parent kills us here, one chunk written

    file_backend.FileStorage._write_page_file = slow_write
    storage = file_backend.FileStorage(sys.argv[1], HiCacheStorageConfig(tp_rank=0, tp_size=2))
    storage.set("page", torch.ones(int(sys.argv[2])))
    print("finished", flush=True)
    """
)


def test_a_writer_killed_mid_write_leaves_no_page_that_reads_as_valid(tmp_path: Path) -> None:
    config = HiCacheStorageConfig(tp_rank=0, tp_size=2)
    other_rank = FileStorage(tmp_path, HiCacheStorageConfig(tp_rank=1, tp_size=2))
    other_rank.set("page", torch.full((8,), 7.0))
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(PAGE_NUMEL)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "chunk"  # the write is under way
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    # kill mid-write -> the torn bytes sit in a temporary file, never under the page's name
    reader = FileStorage(tmp_path, config)
    assert any(p.name.endswith(TEMP_FILE_SUFFIX) for p in tmp_path.iterdir())
    assert not reader.exists("page")
    assert reader.get("page", torch.zeros(PAGE_NUMEL)) is None
    # a new write of the same page succeeds, and clear() takes this rank's leftovers only
    assert reader.set("page", torch.ones(PAGE_NUMEL))
    assert torch.equal(reader.get("page", torch.zeros(PAGE_NUMEL)), torch.ones(PAGE_NUMEL))  # type: ignore[arg-type]
    reader.clear()
    assert not any(p.name.endswith(TEMP_FILE_SUFFIX) for p in tmp_path.iterdir())
    assert other_rank.exists("page")
