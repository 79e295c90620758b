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
from hicache_ref.harness.adapters.base import CAPABILITIES, BuildRequest
from hicache_ref.harness.adapters.contract import ImplementationBase
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

SEED_CAPABILITIES = CAPABILITIES - {"guards", "storage", "reset_drains"}
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


def is_l2_engine_tree(tree: Path) -> bool:
    """Whether the tree's controller drives transfers through ``L2TransferEngine`` (0.5.23+)."""
    return (tree / "sglang" / "srt" / "mem_cache" / "l2_transfer.py").is_file()


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
    if is_l2_engine_tree(tree):  # 0.5.23 and later: L2TransferEngine, pool_host/, runtime ctx
        _package("sglang.srt.mem_cache.pool_host")
        _stub("sglang.srt.mem_cache.pool_host.base", shared_host_layout_domains=lambda pools: [])
        _stub(
            "sglang.srt.mem_cache.utils",
            get_hash_str=_no_storage,
            get_storage_hash_str=_no_storage,
        )
        _stub("sglang.srt.runtime_context", get_parallel=lambda: _SINGLE_RANK)
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
        self._last: tuple[Any, types.ModuleType] | None = None

    def module_for(self, device: Any) -> types.ModuleType:
        """The controller module bound to ``device`` (the last one is reused)."""
        if self._last is not None and self._last[0] is device:
            return self._last[1]
        install_stubs(self.tree)
        _CURRENT_DEVICE[0] = device
        module = None
        try:
            for name, path, code in self.codes:
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
        finally:
            _CURRENT_DEVICE[0] = None
        assert module is not None
        self._last = (device, module)
        return module


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


class L2HostPoolShim:
    """The host-pool names 0.5.23's ``L2TransferEngine`` calls, over this project's pool.

    0.5.23 renamed the copy entry points (``*_physical``) and added a per-submission index hook;
    for a plain (non-compacting) pool upstream's own base class forwards them exactly like this.
    Everything else is the harness's pool itself, so the harness reads the same slots.
    """

    storage_format_tag = None

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    @property
    def logical_size(self) -> int:
        return int(self._pool.size)

    def prepare_transfer_indices(self, host_indices: Any, device_indices: Any, io: str) -> Any:
        return host_indices, device_indices

    def backup_from_device_all_layer_physical(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: str
    ) -> None:
        self._pool.backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )

    def load_to_device_per_layer_physical(
        self,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        self._pool.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend
        )


class L2AllocatorShim:
    """0.5.23's allocator hook ``set_hicache_transfer_done_event`` over this project's allocator.

    Upstream's allocator defers reuse of freed pages until that event; the harness's tree never
    frees pages a transfer still uses (it pins them until the ack drains), so the events are
    recorded and the free path is unchanged.
    """

    def __init__(self, allocator: Any) -> None:
        self._allocator = allocator
        self.transfer_done_events: dict[object, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._allocator, name)

    def set_hicache_transfer_done_event(self, key: object, event: Any) -> None:
        self.transfer_done_events[key] = event


class SglangImplementation(ImplementationBase):
    """Upstream SGLang's controller from a tree (``--impl sglang``)."""

    name = "sglang"
    capabilities = UPSTREAM_CAPABILITIES

    def __init__(self, tree: Path | None = None) -> None:
        self.tree = tree if tree is not None else resolve_tree()
        self.loader = controller_source(self.tree)
        self.source_tree = str(self.tree)  # recorded in trace headers (replay rebuilds it)
        self._producer_slots: int | None = None

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        """The implementation's producer-slot count is a constant of its LayerDoneCounter."""
        from hicache_ref.device.sim import SimDevice

        if self._producer_slots is None:
            self._producer_slots = _producer_slots(self.loader.module_for(SimDevice()))
        return config.model_copy(update={"num_counters": self._producer_slots})

    def build_controller(self, request: BuildRequest) -> Any:
        module = self.loader.module_for(request.device_module)
        l2_engine = is_l2_engine_tree(self.tree)
        allocator = L2AllocatorShim(request.allocator) if l2_engine else request.allocator
        host_pool = L2HostPoolShim(request.host_pool) if l2_engine else request.host_pool
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
            # 0.5.23 keeps its two streams on the transfer engine; the harness advances them
            controller.write_stream = engine.device_to_host_stream
            controller.load_stream = engine.host_to_device_stream
        if not hasattr(controller, "evict_device"):
            # 0.5.23 dropped evict_device: its radix cache frees device pages itself, with the
            # allocator's free, which is what this does
            controller.evict_device = _allocator_free(request.allocator)
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
