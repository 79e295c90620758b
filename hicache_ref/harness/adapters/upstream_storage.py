"""SGLang's own ``HiCacheFile``, read from an unpacked sglang tree, behind this project's interface.

The gate's loader (``harness/adapters/sglang.py``: ``install_stubs``) already executes the
tree's real ``srt/mem_cache/hicache_storage.py``; ``load_upstream_storage_module`` adds what
0.5.23's ``HiCacheFile`` imports lazily (its LRU file evictor, read from the same tree) and
returns that module. ``UpstreamFileStorage`` then wraps one ``HiCacheFile`` over a directory:
real files, written and read by upstream's code, so a storage world can run upstream's backend
under this project's tier and checks. Nothing of sglang is imported as a package.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hicache_ref.errors import HiCacheSetupError
from hicache_ref.storage.backend import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from hicache_ref.storage.protocols import StorageHostPool

UPSTREAM_STORAGE_VERSION = "0.5.23"
STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"
STORAGE_RELPATH = Path("sglang/srt/mem_cache/hicache_storage.py")
EVICTOR_RELPATH = Path("sglang/srt/mem_cache/storage/file/lru_file_evictor.py")
DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def _human_readable_int(value: object) -> int:
    """What ``sglang.srt.utils.common.human_readable_int`` answers for the evictor's options."""
    text = str(value).strip().lower()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


def load_upstream_storage_module(tree: Path) -> types.ModuleType:
    """The tree's ``hicache_storage`` module, with what its ``HiCacheFile`` needs loaded."""
    from hicache_ref.harness.adapters.sglang_stubs import _load_real, _package, _stub, install_stubs

    install_stubs(tree)
    evictor = tree / EVICTOR_RELPATH
    name = "sglang.srt.mem_cache.storage.file.lru_file_evictor"
    if evictor.is_file() and name not in sys.modules:
        mem_cache = tree / "sglang" / "srt" / "mem_cache"
        _package("sglang.srt.mem_cache.storage", mem_cache / "storage")
        _package("sglang.srt.mem_cache.storage.file", mem_cache / "storage" / "file")
        _stub("sglang.srt.utils.common", human_readable_int=_human_readable_int)
        _load_real(name, evictor)
    return sys.modules[STORAGE_MODULE]


def _upstream_config(module: types.ModuleType, config: HiCacheStorageConfig, root: Path) -> Any:
    """Upstream's ``HiCacheStorageConfig`` for ``config``, with the fields its version has."""
    values: dict[str, object] = {
        "tp_rank": config.tp_rank,
        "tp_size": config.tp_size,
        "pp_rank": config.pp_rank,
        "pp_size": config.pp_size,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": config.is_mla_model,
        "enable_storage_metrics": False,
        "is_page_first_layout": config.is_page_first_layout,
        "model_name": config.model_name,
        "extra_config": {"file_storage_path": str(root)},
    }
    cls = module.HiCacheStorageConfig
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


class UpstreamFileStorage(HiCacheStorage):
    """Upstream's ``HiCacheFile`` over ``root_dir``: every call goes to upstream's code."""

    def __init__(self, tree: Path, root_dir: Path, config: HiCacheStorageConfig) -> None:
        super().__init__(config)
        if os.environ.get(DIR_ENV):
            raise HiCacheSetupError(
                f"{DIR_ENV} is set, so upstream's HiCacheFile would ignore the directory the "
                "harness gives it; unset it to run upstream's file backend"
            )
        root_dir.mkdir(parents=True, exist_ok=True)
        module = load_upstream_storage_module(tree)
        self.tree, self.root_dir = tree, root_dir
        self.upstream = module.HiCacheFile(
            _upstream_config(module, config, root_dir), str(root_dir)
        )

    @property
    def namespace(self) -> str:
        return str(self.upstream.config_suffix).lstrip("_")

    def register_mem_pool_host(self, mem_pool_host: StorageHostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.upstream.mem_pool_host = mem_pool_host

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        page: torch.Tensor | None = self.upstream.get(
            key, self._require_target(key, target_location)
        )
        return page

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[torch.Tensor | None]:
        targets = (
            list(target_locations)
            if target_locations is not None
            else [self._require_target(key, None) for key in keys]
        )
        return list(self.upstream.batch_get(list(keys), targets))

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        return bool(self.upstream.set(key, value))

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> bool:
        return bool(self.upstream.batch_set(list(keys), list(values or [])))

    def exists(self, key: str) -> bool:
        return bool(self.upstream.exists(key))

    def batch_exists(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return int(self.upstream.batch_exists(list(keys)))

    def clear(self) -> None:
        self.upstream.clear()

    def close(self) -> None:
        close = getattr(self.upstream, "close", None)
        if callable(close):
            close()

    def get_stats(self) -> Mapping[str, int] | None:
        return None
