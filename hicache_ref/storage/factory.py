"""``StorageBackendFactory``: backend names -> builders (SGLang's factory of the same name).

Built in: ``"memory"`` (``MemoryStorage``) and ``"file"`` (``FileStorage``; its directory comes
from ``extra["root_dir"]`` or else ``config.extra_config["root_dir"]``). Tests and harnesses
register more (a fault-injecting wrapper, a backend that fails to build) under their own names.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import ClassVar

from hicache_ref.errors import HiCacheInputError, UnknownOptionError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.protocols import StorageHostPool

BackendBuilder = Callable[
    [HiCacheStorageConfig, "StorageHostPool | None", Mapping[str, object]], HiCacheStorage
]
"""Builds a backend from (config, host pool or None, extra options)."""


def build_memory_backend(
    config: HiCacheStorageConfig,
    mem_pool_host: StorageHostPool | None,
    extra: Mapping[str, object],
) -> HiCacheStorage:
    return MemoryStorage(config)


def build_file_backend(
    config: HiCacheStorageConfig,
    mem_pool_host: StorageHostPool | None,
    extra: Mapping[str, object],
) -> HiCacheStorage:
    root_dir = extra.get("root_dir", config.extra_config.get("root_dir"))
    if not isinstance(root_dir, (str, os.PathLike)):
        raise HiCacheInputError(
            "the 'file' storage backend needs a directory: pass "
            "storage_backend_extra_config={'root_dir': '/path/to/dir'}"
        )
    return FileStorage(root_dir, config)


BUILTIN_BACKENDS: Mapping[str, BackendBuilder] = {
    "memory": build_memory_backend,
    "file": build_file_backend,
}


class StorageBackendFactory:
    """A process-wide registry of backend builders (built-ins cannot be replaced or removed)."""

    _builders: ClassVar[dict[str, BackendBuilder]] = dict(BUILTIN_BACKENDS)
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get_backend_names(cls) -> tuple[str, ...]:
        with cls._lock:
            return tuple(sorted(cls._builders))

    @classmethod
    def register_backend(cls, name: str, builder: BackendBuilder, *, replace: bool = False) -> None:
        """Make ``name`` buildable; re-registering needs ``replace=True``."""
        if not name or name in BUILTIN_BACKENDS:
            raise HiCacheInputError(
                f"cannot register storage backend {name!r}: names must be non-empty and not "
                f"one of the built-ins {', '.join(sorted(BUILTIN_BACKENDS))}"
            )
        with cls._lock:
            if name in cls._builders and not replace:
                raise HiCacheInputError(
                    f"storage backend {name!r} is registered already (pass replace=True)"
                )
            cls._builders[name] = builder

    @classmethod
    def unregister_backend(cls, name: str) -> None:
        """Forget a registered backend; unknown names and built-ins raise."""
        with cls._lock:
            if name in BUILTIN_BACKENDS or name not in cls._builders:
                raise HiCacheInputError(
                    f"cannot unregister storage backend {name!r}: only registered, non-built-in "
                    f"names can be removed ({', '.join(sorted(set(cls._builders) - set(BUILTIN_BACKENDS))) or 'none registered'})"
                )
            del cls._builders[name]

    @classmethod
    def create_backend(
        cls,
        name: str,
        config: HiCacheStorageConfig,
        mem_pool_host: StorageHostPool | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> HiCacheStorage:
        """Build the backend registered as ``name``; unknown names raise ``UnknownOptionError``."""
        with cls._lock:
            builder = cls._builders.get(name)
            legal = sorted(cls._builders)
        if builder is None:
            raise UnknownOptionError(
                f"unknown storage backend {name!r}; legal values: {', '.join(legal)} "
                "(or register one with StorageBackendFactory.register_backend)"
            )
        return builder(config, mem_pool_host, extra if extra is not None else {})
