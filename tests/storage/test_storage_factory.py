"""The backend factory: built-in names, registration, and the message for unknown names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from hicache_ref.errors import HiCacheInputError, UnknownOptionError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.protocols import StorageHostPool


def build_custom(
    config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
) -> HiCacheStorage:
    return MemoryStorage(config)


@pytest.fixture
def custom_name() -> Iterator[str]:
    StorageBackendFactory.register_backend("test-custom", build_custom)
    yield "test-custom"
    StorageBackendFactory.unregister_backend("test-custom")


def test_memory_and_file_are_built_in(tmp_path: Path) -> None:
    config = HiCacheStorageConfig(extra_config={"root_dir": str(tmp_path)})
    assert isinstance(StorageBackendFactory.create_backend("memory", config), MemoryStorage)
    assert isinstance(StorageBackendFactory.create_backend("file", config), FileStorage)


def test_file_backend_takes_root_dir_from_extra_first(tmp_path: Path) -> None:
    backend = StorageBackendFactory.create_backend(
        "file", HiCacheStorageConfig(), None, {"root_dir": tmp_path / "x"}
    )
    assert isinstance(backend, FileStorage) and backend.root_dir == tmp_path / "x"


def test_file_backend_without_a_directory_names_the_fix() -> None:
    with pytest.raises(HiCacheInputError, match="storage_backend_extra_config=\\{'root_dir'"):
        StorageBackendFactory.create_backend("file", HiCacheStorageConfig())


def test_unknown_backend_lists_the_legal_names() -> None:
    with pytest.raises(UnknownOptionError) as info:
        StorageBackendFactory.create_backend("hf3fs", HiCacheStorageConfig())
    assert "unknown storage backend 'hf3fs'; legal values: file, memory" in str(info.value)


def test_registered_backend_is_buildable_and_listed(custom_name: str) -> None:
    assert custom_name in StorageBackendFactory.get_backend_names()
    backend = StorageBackendFactory.create_backend(custom_name, HiCacheStorageConfig())
    assert isinstance(backend, MemoryStorage)


def test_registering_twice_needs_replace(custom_name: str) -> None:
    with pytest.raises(HiCacheInputError, match="replace=True"):
        StorageBackendFactory.register_backend(custom_name, build_custom)
    StorageBackendFactory.register_backend(custom_name, build_custom, replace=True)


def test_built_ins_cannot_be_replaced_or_removed() -> None:
    with pytest.raises(HiCacheInputError, match="built-ins"):
        StorageBackendFactory.register_backend("memory", build_custom, replace=True)
    with pytest.raises(HiCacheInputError, match="cannot unregister"):
        StorageBackendFactory.unregister_backend("file")
