"""How a controller file of an sglang tree imports without the rest of sglang: the stubs.

``install_stubs(tree)`` makes ``import sglang.srt...`` resolve against the tree: a package shell
``sglang`` whose ``__path__`` is the tree, so the real ``srt/environ.py`` and
``srt/mem_cache/hicache_storage.py`` load from it; stub modules for the controller's other
direct imports (``srt.utils.get_device_module``, ``srt.distributed``, ``srt.layers.dp_attention``,
``runtime_context``), this project's pools as ``srt.mem_cache.memory_pool`` /
``memory_pool_host`` so the controller's ``isinstance`` checks see the pools it is handed, and
the fork-only modules served by this project's equivalents. ``install_group_stubs(tree)`` adds
what 0.5.19+'s ``hybrid_cache_controller.py`` imports, with upstream's own
``pool_host/group.py``. A new import in a release is one line here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.sglang_hashes import tree_hash_functions

FORK_ENV_FLAGS: dict[str, object] = {
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING": False,
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING_SLOW_MS": 0.0,
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING_LIMIT": 0,
}
"""Environment flags the fork reads that 0.5.10's ``srt/environ.py`` does not define (defaults)."""


class _EnvFlag:
    """A stand-in for sglang's ``EnvField``: ``.get()`` reads the variable or the default."""

    def __init__(self, name: str, default: object) -> None:
        self.name, self.default = name, default

    def get(self) -> object:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.lower() in ("1", "true", "yes")
        return type(self.default)(raw)  # type: ignore[call-arg]


class _ForkEnvs:
    """sglang's ``envs`` plus the fork-only flags (``FORK_ENV_FLAGS``)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._real, name)
        except AttributeError:
            if name in FORK_ENV_FLAGS:
                return _EnvFlag(name, FORK_ENV_FLAGS[name])
            raise


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__hicache_stub__ = True  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    module = _stub(name)
    module.__path__ = [str(path)] if path is not None else []
    return module


def _no_parallel_group(*args: Any, **kwargs: Any) -> Any:
    raise HiCacheSetupError("the gate runs TP 1: a custom parallel group was asked for")


def _no_device() -> Any:
    return None  # a controller module is executed under ``device_module_for``


def _swap(module_name: str, attr: str, value: Any) -> Iterator[None]:
    module = sys.modules[module_name]
    saved = module.__dict__[attr]
    module.__dict__[attr] = value
    try:
        yield
    finally:
        module.__dict__[attr] = saved


@contextmanager
def device_module_for(device: Any) -> Iterator[None]:
    """While a controller module executes: the stub ``get_device_module()`` answers ``device``
    (the module calls it at import time and keeps what it got)."""
    yield from _swap("sglang.srt.utils", "get_device_module", lambda: device)


@contextmanager
def sync_groups_for(factory: Callable[..., Any]) -> Iterator[None]:
    """While one storage rank attaches: ``create_custom_parallel_group`` is ``factory``
    (upstream imports it inside attach); outside, a request for a group is refused."""
    yield from _swap(
        "sglang.srt.distributed.parallel_state", "create_custom_parallel_group", factory
    )


def _no_storage(*args: Any, **kwargs: Any) -> Any:
    raise HiCacheSetupError("the gate drives no storage tier: a storage hash was asked for")


_SINGLE_RANK = types.SimpleNamespace(
    tp_rank=0,
    tp_size=1,
    pp_rank=0,
    pp_size=1,
    attn_tp_rank=0,
    attn_tp_size=1,
    attn_dp_rank=0,
    attn_dp_size=1,
    attn_cp_rank=0,
    attn_cp_size=1,
    attn_dcp_rank=0,
    attn_dcp_size=1,
)


def _tree_hashes(tree: Path) -> dict[str, Any]:
    try:
        return tree_hash_functions(tree)
    except HiCacheSetupError:
        return {}  # an older tree: its get_hash_str lives in hicache_storage.py (loaded below)


def installed_tree() -> Path | None:
    """The tree ``install_stubs`` last installed whole, read off the ``sglang`` shell in
    ``sys.modules`` (the one place the installation lives), or None."""
    shell = sys.modules.get("sglang")
    tree = getattr(shell, "__hicache_tree__", None)
    return tree if isinstance(tree, Path) else None


def install_stubs(tree: Path) -> None:
    """Make ``import sglang.srt...`` resolve against ``tree`` plus the stubs (idempotent)."""
    if installed_tree() == tree:
        return
    from hicache_ref.invariants.models import CpHiCacheNodeMetadata
    from hicache_ref.pools import device_pool, host_pool, host_pool_kinds, hybrid_pool
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.page_index import (
        pad_token_locs_to_page_boundary,
        validate_page_aligned_token_indices,
    )

    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]  # another tree's modules (a second gate in one process)
    root = tree / "sglang"
    _package("sglang", root)
    _package("sglang.srt", root / "srt")
    _package("sglang.srt.mem_cache", root / "srt" / "mem_cache")
    _package("sglang.srt.managers", root / "srt" / "managers")
    _stub(
        "sglang.srt.utils",
        get_device_module=_no_device,
        is_cuda=lambda: False,
        is_hip=lambda: False,
        is_npu=lambda: False,
        is_xpu=lambda: False,
    )
    _package("sglang.srt.distributed")
    sys.modules["sglang.srt.distributed"].__dict__.update(
        get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1,
        get_pipeline_model_parallel_rank=lambda: 0,  # 0.5.13 - 0.5.15
        get_pipeline_model_parallel_world_size=lambda: 1,
    )
    _stub("sglang.srt.distributed.parallel_state", create_custom_parallel_group=_no_parallel_group)
    _package("sglang.srt.layers")
    _stub(
        "sglang.srt.layers.dp_attention",
        is_dp_attention_enabled=lambda: False,
        get_attention_dp_rank=lambda: 0,
        get_attention_tp_rank=lambda: 0,
        get_attention_tp_size=lambda: 1,
    )
    _stub(
        "sglang.srt.mem_cache.memory_pool",
        KVCache=device_pool.KVCache,
        MHATokenToKVPool=device_pool.MHATokenToKVPool,
        MLATokenToKVPool=device_pool.MLATokenToKVPool,
        NSATokenToKVPool=device_pool.NSATokenToKVPool,
        HybridLinearKVPool=hybrid_pool.HybridLinearKVPool,  # upstream unwraps it by isinstance
    )
    _stub(
        "sglang.srt.mem_cache.memory_pool_host",
        HostKVCache=host_pool.HostKVCache,
        MHATokenToKVPoolHost=host_pool_kinds.MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=host_pool_kinds.MLATokenToKVPoolHost,
    )
    # fork-only modules, served by this project's equivalents
    _stub(
        "sglang.srt.mem_cache.cp_shared_kv_layout",
        CpSharedKVLayout=CpSharedKVLayout,
        pad_token_locs_to_page_boundary=pad_token_locs_to_page_boundary,
    )
    _stub(
        "sglang.srt.mem_cache.page_index_utils",
        validate_page_aligned_token_indices=validate_page_aligned_token_indices,
    )
    _stub("sglang.srt.mem_cache.hiradix_cache", CpHiCacheNodeMetadata=CpHiCacheNodeMetadata)
    # modules later releases import (a superset: each tree imports the ones it has)
    _package("sglang.srt.mem_cache.pool_host")  # 0.5.14+: host pools moved here
    _stub("sglang.srt.mem_cache.pool_host.base", shared_host_layout_domains=lambda pools: [])
    hashes: dict[str, Any] = {
        "get_hash_str": _no_storage,
        "get_storage_hash_str": _no_storage,  # 0.5.20+ imports it at module level
    }
    hashes.update(_tree_hashes(tree))  # the tree's own, where its utils.py has them (0.5.20+)
    _stub("sglang.srt.mem_cache.utils", **hashes)
    _stub("sglang.srt.runtime_context", get_parallel=lambda: _SINGLE_RANK)  # 0.5.16+
    environ = _load_real("sglang.srt.environ", root / "srt" / "environ.py")
    environ.__dict__["envs"] = _ForkEnvs(environ.__dict__["envs"])
    _load_real(
        "sglang.srt.mem_cache.hicache_storage", root / "srt" / "mem_cache" / "hicache_storage.py"
    )
    logging.getLogger("sglang").setLevel(logging.ERROR)  # the fork logs a fallback per write
    sys.modules["sglang"].__dict__["__hicache_tree__"] = tree  # stamped last: installed whole


def _load_real(name: str, path: Path) -> types.ModuleType:
    """Execute one real module of the tree (it must import only torch, stubs and the tree)."""
    if not path.is_file():
        raise HiCacheSetupError(f"the sglang tree lacks {path}; gate a complete unpacked tree")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        del sys.modules[name]
        raise HiCacheSetupError(
            f"{path} imports {exc.name or exc}, which the gate does not stub; add a stub in "
            "hicache_ref/harness/adapters/sglang.py (install_stubs)"
        ) from None
    return module


class _StubClass:
    """A class the gate's pools are never instances of (an ``isinstance`` target)."""


class RadixKey:
    """Upstream's ``RadixKey`` as 0.5.23's PP tickets use it (``radix_cache.py`` is not
    loaded): a namespaced token sequence, sliced and page-aligned, picklable; the storage hash
    reads its tokens by iterating it. Non-bigram only (the gate draws no EAGLE bigram keys)."""

    __slots__ = ("cache_salt", "extra_key", "is_bigram", "limit", "token_ids")

    def __init__(
        self,
        token_ids: Any,
        extra_key: str | None = None,
        is_bigram: bool = False,
        limit: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.cache_salt = cache_salt or None
        self.is_bigram = is_bigram
        self.limit = limit

    def _tokens(self) -> list[int]:
        tokens = [int(t) for t in self.token_ids]
        return tokens if self.limit is None else tokens[: self.limit]

    def __len__(self) -> int:
        return len(self._tokens())

    def __iter__(self) -> Any:
        return iter(self._tokens())

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return RadixKey(
                array("q", self._tokens()[index]), self.extra_key, self.is_bigram, None,
                self.cache_salt,
            )  # fmt: skip
        return self._tokens()[index]

    def page_aligned(self, page_size: int) -> RadixKey:
        return self if page_size == 1 else self[: len(self) // page_size * page_size]

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)


def install_group_stubs(tree: Path) -> None:
    """What ``hybrid_cache_controller.py`` imports besides the controller: upstream's own
    ``HostPoolGroup``/``PoolEntry`` (``pool_host/group.py``, run as it is) and classes the
    gate's pools are never instances of (interleaved and envelope pools, request handles)."""
    from hicache_ref.pools import host_pool, host_pool_kinds

    root = tree / "sglang" / "srt" / "mem_cache"
    _package("sglang.srt.mem_cache.hybrid_cache")
    _package("sglang.srt.mem_cache.allocator")
    _stub(
        "sglang.srt.mem_cache.allocator.page_interleave",
        PageInterleavePoolAllocator=type("PageInterleavePoolAllocator", (_StubClass,), {}),
    )
    _stub(
        "sglang.srt.mem_cache.base_prefix_cache",
        CacheRequestHandle=type("CacheRequestHandle", (_StubClass,), {}),
    )
    _stub("sglang.srt.mem_cache.radix_cache", RadixKey=RadixKey)
    base = sys.modules["sglang.srt.mem_cache.pool_host.base"]
    base.__dict__.update(HostKVCache=host_pool.HostKVCache, uses_shared_host_layout=lambda p: False)
    _stub(
        "sglang.srt.mem_cache.pool_host.mha",
        MHATokenToKVPoolHost=host_pool_kinds.MHATokenToKVPoolHost,
    )
    _stub(
        "sglang.srt.mem_cache.pool_host.page_interleave",
        PageInterleaveHostPool=type("PageInterleaveHostPool", (_StubClass,), {}),
    )
    _stub(
        "sglang.srt.mem_cache.pool_host.unified",
        UnifiedPageEnvelopeHostPool=type("UnifiedPageEnvelopeHostPool", (_StubClass,), {}),
    )
    sys.modules["sglang.srt.utils"].__dict__["broadcast_pyobj"] = _no_parallel_group
    group = _load_real("sglang.srt.mem_cache.pool_host.group", root / "pool_host" / "group.py")
    sys.modules["sglang.srt.mem_cache.pool_host"].__dict__.update(
        HostPoolGroup=group.HostPoolGroup, PoolEntry=group.PoolEntry
    )
