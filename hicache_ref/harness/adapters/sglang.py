"""SGLang's own ``HiCacheController``, read from an unpacked tree and driven by the machines.

Two implementations share this loader:

- ``sglang``: upstream's controller (default: the 0.5.10 wheel; ``HICACHE_SGLANG_SRC`` or the
  CLI's ``--sglang-src`` point at any other tree, e.g. a developer's modified copy). It has no
  CP, no draft pools and no guards against unsafe calls, and three producer slots.
- ``seed``: the context-parallel / draft fork this project was made from: the 0.5.10 tree with
  the fork's ``cache_controller.py`` (``sglang_tree.resolve_seed_tree``). Its fork-only imports
  are served by this project's equivalents (``CpSharedKVLayout``, the page-index validators,
  ``CpHiCacheNodeMetadata``, the fork's environment flags).

How a controller file is run without the rest of sglang, in the order it happens:

1. ``install_stubs(tree)``: a package shell ``sglang`` whose ``__path__`` is the tree, so the
   real ``srt/environ.py`` and ``srt/mem_cache/hicache_storage.py`` load from it; stub modules for
   the controller's other direct imports (``srt.utils.get_device_module``, ``srt.distributed``,
   ``srt.layers.dp_attention``), and this project's pools as ``srt.mem_cache.memory_pool`` /
   ``memory_pool_host`` so the controller's ``isinstance`` checks see the pools it is handed.
2. ``ControllerSource.module_for(device)``: the controller file is compiled once and executed
   once per simulated world, with ``get_device_module()`` answering that world's ``SimDevice``
   (the file binds ``device_module`` at import, as upstream binds ``torch.cuda``).
3. ``build_controller``: the module's ``HiCacheController`` over the harness's allocator and host
   pool, with ``tp_group=None`` (no storage, TP 1).

Nothing here reads the implementation's view of itself: the harness checks it from its own model
(``adapters/base.py``'s snapshot reads the ack queues and the harness's own pools).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.base import CAPABILITIES, GROUP_CAPABILITIES, BuildRequest
from hicache_ref.harness.adapters.sglang_group import build_group_controller
from hicache_ref.harness.adapters.sglang_shapes import (
    L2AllocatorShim,
    detect_shape,
    host_pool_shim,
    shape_capabilities,
    wire_draft_pools,
)
from hicache_ref.harness.adapters.sglang_tree import (
    CONTROLLER_RELPATH,
    resolve_seed_tree,
    resolve_tree,
)
from hicache_ref.harness.config import HarnessConfig

UPSTREAM_CAPABILITIES = frozenset(
    {
        "io:direct",
        "io:kernel",
        "layout:layer_first",
        "layout:page_first",
        "layout:page_first_direct",
        "layout:page_head",
        "pool:mha",
        "pool:mla",
        "pool:nsa",
        "pool:hybrid",
    }
)
"""0.5.10: write/load/start_*/evict_*/reset; no CP, no draft pools, no guards, no storage here.
Neither 0.5.10's nor 0.5.23's ``LayerDoneCounter.set_consumer(index: int)`` takes a list (its
``wait_until`` compares the index with 0: no ``multi_consumer``), and neither ``reset()``
synchronizes a stream before clearing the queues (no ``reset_drains``)."""

SEED_CAPABILITIES = CAPABILITIES - {
    "guards",
    "storage",
    "reset_drains",
    "fence_streams",
    *GROUP_CAPABILITIES,
}
# the fork's move_indices also drives layer_page_first (direct) and unwraps hybrid pools
"""The fork adds CP shared KV (reserve/submit/load_cp/evict_cp_host), per-layer write-back and
draft pools; like upstream it does not refuse unsafe calls. Its ``LayerDoneCounter`` takes a
list of consumer slots and waits on each (``multi_consumer``); its ``reset()`` clears the queues
without synchronizing the write or load stream (no ``reset_drains``)."""

FORK_ENV_FLAGS: dict[str, object] = {
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING": False,
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING_SLOW_MS": 0.0,
    "SGLANG_CP_SHARED_KV_BS_GT1_TIMING_LIMIT": 0,
}
"""Environment flags the fork reads that 0.5.10's ``srt/environ.py`` does not define (defaults)."""

_CURRENT_DEVICE: list[Any] = [None]  # what the stub get_device_module() answers while loading


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


_INSTALLED: list[Path | None] = [None]


def install_stubs(tree: Path) -> None:
    """Make ``import sglang.srt...`` resolve against ``tree`` plus the stubs (idempotent)."""
    if _INSTALLED[0] == tree:
        return
    from hicache_ref.invariants.models import CpHiCacheNodeMetadata
    from hicache_ref.pools import device_pool, host_pool, hybrid_pool
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
        get_device_module=lambda: _CURRENT_DEVICE[0],
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
        MHATokenToKVPoolHost=host_pool.MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=host_pool.MLATokenToKVPoolHost,
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
    _stub(
        "sglang.srt.mem_cache.utils",
        get_hash_str=_no_storage,
        get_storage_hash_str=_no_storage,  # 0.5.20+ imports it at module level
    )
    _stub("sglang.srt.runtime_context", get_parallel=lambda: _SINGLE_RANK)  # 0.5.16+
    environ = _load_real("sglang.srt.environ", root / "srt" / "environ.py")
    environ.__dict__["envs"] = _ForkEnvs(environ.__dict__["envs"])
    _load_real(
        "sglang.srt.mem_cache.hicache_storage", root / "srt" / "mem_cache" / "hicache_storage.py"
    )
    logging.getLogger("sglang").setLevel(logging.ERROR)  # the fork logs a fallback per write
    _INSTALLED[0] = tree


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


PER_WORLD_MODULES = (
    ("sglang.srt.mem_cache.l2_transfer", Path("sglang/srt/mem_cache/l2_transfer.py")),
    ("sglang.srt.managers.cache_controller", CONTROLLER_RELPATH),
)
HYBRID_CONTROLLER_RELPATH = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py")
"""Modules that bind ``device_module = get_device_module()`` at import: executed per world."""


class ControllerSource:
    """One controller file (and, on 0.5.23, its transfer engine), compiled once, executed once
    per simulated world (device)."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.path = tree / CONTROLLER_RELPATH
        install_stubs(tree)
        self.codes: list[tuple[str, Path, types.CodeType]] = []
        for name, relpath in PER_WORLD_MODULES:
            path = tree / relpath
            if not path.is_file():
                continue
            try:
                code = compile(path.read_text(), str(path), "exec")
            except SyntaxError as exc:
                raise HiCacheSetupError(
                    f"{path}:{exc.lineno}: the file does not compile ({exc.msg})"
                ) from None
            self.codes.append((name, path, code))
        self._last: tuple[Any, dict[str, types.ModuleType]] | None = None
        self._hybrid_code: types.CodeType | None = None

    def module_for(self, device: Any) -> types.ModuleType:
        """The controller module bound to ``device`` (the last one is reused)."""
        return self._world_modules(device)[CONTROLLER_MODULE]

    def _world_modules(self, device: Any) -> dict[str, types.ModuleType]:
        if self._last is not None and self._last[0] is device:
            return self._last[1]
        install_stubs(self.tree)
        _CURRENT_DEVICE[0] = device
        modules: dict[str, types.ModuleType] = {}
        try:
            for name, path, code in self.codes:
                modules[name] = _exec_module(name, path, code)
        finally:
            _CURRENT_DEVICE[0] = None
        self._last = (device, modules)
        return modules

    def hybrid_module_for(self, device: Any) -> types.ModuleType:
        """0.5.19+'s ``hybrid_cache_controller`` over the controller module bound to
        ``device`` (its ``HostPoolGroup`` and the stubs it imports installed first)."""
        modules = self._world_modules(device)
        if "hybrid" in modules:
            return modules["hybrid"]
        path = self.tree / HYBRID_CONTROLLER_RELPATH
        if "sglang.srt.mem_cache.pool_host.group" not in sys.modules:  # once per installed tree
            install_group_stubs(self.tree)
        if self._hybrid_code is None:
            self._hybrid_code = compile(path.read_text(), str(path), "exec")
        for name, module in modules.items():
            sys.modules[name] = module  # its imports see this world's controller and engine
        modules["hybrid"] = _exec_module(HYBRID_MODULE, path, self._hybrid_code)
        return modules["hybrid"]


def _exec_module(name: str, path: Path, code: types.CodeType) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except ImportError as exc:
        raise HiCacheSetupError(
            f"{path} imports {exc.name or exc}, which the gate does not stub; add a "
            "stub in hicache_ref/harness/adapters/sglang.py (install_stubs)"
        ) from None
    return module


CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
HYBRID_MODULE = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"


class _StubClass:
    """A class the gate's pools are never instances of (an ``isinstance`` target)."""


def install_group_stubs(tree: Path) -> None:
    """What ``hybrid_cache_controller.py`` imports besides the controller: upstream's own
    ``HostPoolGroup``/``PoolEntry`` (``pool_host/group.py``, run as it is) and classes the
    gate's pools are never instances of (interleaved and envelope pools, request handles)."""
    from hicache_ref.pools import host_pool

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
    _stub("sglang.srt.mem_cache.radix_cache", RadixKey=type("RadixKey", (_StubClass,), {}))
    base = sys.modules["sglang.srt.mem_cache.pool_host.base"]
    base.__dict__.update(HostKVCache=host_pool.HostKVCache, uses_shared_host_layout=lambda p: False)
    _stub("sglang.srt.mem_cache.pool_host.mha", MHATokenToKVPoolHost=host_pool.MHATokenToKVPoolHost)
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


_SOURCES: dict[Path, ControllerSource] = {}


def controller_source(tree: Path) -> ControllerSource:
    source = _SOURCES.get(tree)
    if source is None:
        source = _SOURCES[tree] = ControllerSource(tree)
    return source


def _allocator_free(allocator: Any) -> Callable[[Any], int]:
    def evict_device(device_indices: Any) -> int:
        allocator.free(device_indices)
        return len(device_indices)

    return evict_device


def _producer_slots(module: types.ModuleType) -> int:
    counter = module.LayerDoneCounter(1)
    return int(counter.num_counters)


class SglangImplementation:
    """Upstream SGLang's controller from a tree (``--impl sglang``)."""

    name = "sglang"
    capabilities = UPSTREAM_CAPABILITIES

    def __init__(self, tree: Path | None = None) -> None:
        self.tree = tree if tree is not None else resolve_tree()
        self.loader = controller_source(self.tree)
        self.source_tree = str(self.tree)  # recorded in trace headers (replay rebuilds it)
        self._producer_slots: int | None = None
        self.shape = detect_shape(self.tree)  # which release shape, read from its files
        self.group_refused = ""  # why the tree's HybridCacheController is not drawn, if not
        if self.name != "sglang":
            return  # the fork declares its own surface (SEED_CAPABILITIES)
        self.capabilities = UPSTREAM_CAPABILITIES | shape_capabilities(self.shape)
        if "hybrid" in self.shape.features:
            self.group_refused = self._try_hybrid()
            if not self.group_refused:
                self.capabilities = self.capabilities | GROUP_CAPABILITIES

    def _try_hybrid(self) -> str:
        from hicache_ref.device.sim import SimDevice

        try:
            self.loader.hybrid_module_for(SimDevice())
        except HiCacheSetupError as exc:
            return str(exc)
        return ""

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        """The implementation's producer-slot count is a constant of its LayerDoneCounter."""
        from hicache_ref.device.sim import SimDevice

        if self._producer_slots is None:
            self._producer_slots = _producer_slots(self.loader.module_for(SimDevice()))
        return config.model_copy(update={"num_counters": self._producer_slots})

    def build_controller(self, request: BuildRequest) -> Any:
        module = self.loader.module_for(request.device_module)
        shape = self.shape
        l2_engine = shape.engine != "streams"
        allocator: Any = request.allocator
        if l2_engine:
            allocator = L2AllocatorShim(request.allocator, request.device_module)
        host_pool = host_pool_shim(shape, request.host_pool)
        if request.config.pool_group != "none":  # 0.5.19+: HybridCacheController over a group
            hybrid = self.loader.hybrid_module_for(request.device_module)
            controller = build_group_controller(
                hybrid, request, allocator, request.config.io_backend
            )
        else:
            controller = module.HiCacheController(
                allocator,
                host_pool,
                request.config.page_size,
                None,  # tp_group: TP 1, no storage
                threading.Event(),
                write_policy="write_through",
                io_backend=request.config.io_backend,
            )
        engine = getattr(controller, "l2_transfer_engine", None)
        if engine is not None and not hasattr(controller, "write_stream"):
            # 0.5.18+ keeps its two streams on the transfer engine; the harness advances them
            controller.write_stream = engine.device_to_host_stream
            controller.load_stream = engine.host_to_device_stream
        if not hasattr(controller, "evict_device"):
            # 0.5.21 dropped evict_device: its radix cache frees device pages itself, with the
            # allocator's free, which is what this does
            controller.evict_device = _allocator_free(allocator)
        if request.draft_device_pool is not None and request.config.pool_group == "none":
            wire_draft_pools(controller, request, shape)
        return controller


class SeedImplementation(SglangImplementation):
    """The fork (CP shared KV, per-layer write-back, drafts) from its tree (``--impl seed``)."""

    name = "seed"
    capabilities = SEED_CAPABILITIES

    def __init__(self, tree: Path | None = None) -> None:
        super().__init__(tree if tree is not None else resolve_seed_tree())

    def build_controller(self, request: BuildRequest) -> Any:
        module = self.loader.module_for(request.device_module)
        kwargs: dict[str, Any] = {}
        if request.cp_layout is not None:
            kwargs["cp_shared_kv_layout"] = request.cp_layout
        if request.draft_device_pool is not None:
            kwargs["draft_mem_pool_host"] = request.draft_host_pool
            kwargs["draft_mem_pool_device"] = request.draft_device_pool
        controller = module.HiCacheController(
            request.allocator,
            request.host_pool,
            request.config.page_size,
            None,
            threading.Event(),
            write_policy="write_through",
            io_backend=request.config.io_backend,
            **kwargs,
        )
        return controller


FACTORIES: dict[str, Callable[[], Any]] = {
    "sglang": SglangImplementation,
    "seed": SeedImplementation,
}
