"""``FileStorage``: one file per page under a root directory (SGLang's ``HiCacheFile``).

A page is written to a temporary file in the same directory and moved into place with
``os.replace``, so a reader sees either no file or the whole page, never a torn one, even when
the writer is killed mid-write (INV-30). A key that already exists is skipped (first writer
wins; equal keys mean equal content). A missing file reads as ``None``; a file of the wrong size
raises ``OSError`` from ``get`` and reads as ``None`` from ``batch_get``, so a prefetch stops at
the damaged page instead of killing its thread. Ranks share one directory: every file name ends
with the writer's namespace, and ``clear`` removes only its own files (INV-28).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig

logger = logging.getLogger("hicache_ref.storage")

PAGE_FILE_SUFFIX = ".bin"
TEMP_FILE_SUFFIX = ".part"
WRITE_CHUNK_BYTES = 1 << 20
"""Bytes per ``write`` call of a page file."""


class FileStorage(HiCacheStorage):
    """Pages as files ``<root_dir>/<storage key>.bin`` holding the page's raw bytes."""

    def __init__(
        self, root_dir: str | os.PathLike[str], config: HiCacheStorageConfig | None = None
    ):
        super().__init__(config)
        self.root_dir = Path(root_dir)
        self.root_dir.mkdir(parents=True, exist_ok=True)

    def _page_path(self, key: str) -> Path:
        return self.root_dir / f"{self._storage_key(key)}{PAGE_FILE_SUFFIX}"

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        """Read the page into ``target_location``; ``OSError`` if the file has the wrong size."""
        target = self._require_target(key, target_location)
        if not target.is_contiguous() or target.device.type != "cpu":
            raise HiCacheInputError(
                f"get({key!r}) reads into a contiguous CPU tensor, got device "
                f"{target.device} contiguous={target.is_contiguous()}"
            )
        path = self._page_path(key)
        target_bytes = target.view(torch.uint8).reshape(-1)
        expected = target_bytes.numel()
        try:
            with open(path, "rb") as page_file:
                read = page_file.readinto(target_bytes.numpy().data)
                trailing = page_file.read(1)
        except FileNotFoundError:
            return None
        # Verify the whole page and nothing more was read: a short file is a torn or foreign
        # page, a long one a different page format
        if read != expected or trailing:
            raise OSError(
                f"page file {path} holds {'more than ' if trailing else ''}{read} bytes, "
                f"expected {expected}"
            )
        return target

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[torch.Tensor | None]:
        """``get`` per key; a damaged page reads as ``None`` (logged) so callers stop there."""
        if target_locations is not None and len(target_locations) != len(keys):
            raise HiCacheInputError(
                f"batch_get got {len(keys)} keys but {len(target_locations)} target_locations"
            )
        pages: list[torch.Tensor | None] = []
        for i, key in enumerate(keys):
            target = None if target_locations is None else target_locations[i]
            try:
                pages.append(self.get(key, target))
            except OSError as exc:
                logger.warning("storage page %s unreadable: %s", key, exc)
                pages.append(None)
        return pages

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        """Write the page atomically unless the key exists; False if the write failed."""
        if value is None:
            raise HiCacheInputError(
                f"FileStorage.set({key!r}) needs a value (zero-copy writes are not supported)"
            )
        path = self._page_path(key)
        if path.exists():
            return True  # first writer wins
        data = value.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        try:
            fd, tmp_name = tempfile.mkstemp(
                dir=self.root_dir, prefix=self._temp_prefix(), suffix=TEMP_FILE_SUFFIX
            )
            try:
                with os.fdopen(fd, "wb") as tmp_file:
                    self._write_page_file(tmp_file, memoryview(data.numpy().tobytes()))
                os.replace(tmp_name, path)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        except OSError as exc:
            logger.warning("storage page %s not written: %s", key, exc)
            return False
        return True

    def _write_page_file(self, tmp_file: BinaryIO, data: memoryview) -> None:
        """Write the page bytes chunk by chunk (a crash between chunks leaves a temp file)."""
        for start in range(0, len(data), WRITE_CHUNK_BYTES):
            tmp_file.write(data[start : start + WRITE_CHUNK_BYTES])

    def _temp_prefix(self) -> str:
        return f".tmp-{self.namespace}-"

    def exists(self, key: str) -> bool:
        return self._page_path(key).exists()

    def clear(self) -> None:
        """Delete this namespace's page files and leftover temporary files, nothing else."""
        page_suffix = f"_{self.namespace}{PAGE_FILE_SUFFIX}"
        temp_prefix = self._temp_prefix()
        for path in self.root_dir.iterdir():
            name = path.name
            mine = name.endswith(page_suffix) or (
                name.startswith(temp_prefix) and name.endswith(TEMP_FILE_SUFFIX)
            )
            if mine and path.is_file():
                path.unlink(missing_ok=True)
