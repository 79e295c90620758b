"""The shapes of upstream's controller across releases, read from a tree, and a shim per shape.

Between 0.5.10 and 0.5.23 the controller's surface changed in three steps, and the gate adapts
each step with a thin shim over this project's pools (``detect_shape`` reads which one a tree
has from its files, never from a version string, so a checkout between releases works too):

- ``streams`` (0.5.10 - 0.5.17): copies on the controller's own ``write_stream`` /
  ``load_stream``; ``evict_device`` frees device pages. No shim.
- ``l2-v1`` (0.5.18 - 0.5.20): copies issued by ``L2TransferEngine``, whose two streams the
  adapter aliases as ``write_stream`` / ``load_stream``; the host pool's
  ``load_to_device_per_layer`` takes ``is_draft=`` (``L2V1HostPoolShim``).
- ``l2-v2`` (0.5.21 - 0.5.23): ``*_physical`` copy names, ``prepare_transfer_indices``, shared
  layout domains, no ``evict_device`` (``L2HostPoolShim``; ``evict_device`` is the allocator's
  free, which is what upstream's radix cache calls).

On top of the engine, a shape carries the features a tree's controller has, each found by the
name that introduces it:

- ``draft`` (``set_draft_kv_pool``, 0.5.11 - 0.5.18): a draft pool pair rides along with every
  transfer, reusing the target's host slots (``wire_draft_pools``);
- ``hybrid`` (0.5.19+): a ``HybridCacheController`` over a ``HostPoolGroup`` with packed draft
  pools (``sglang_group.py``; 0.5.19 - 0.5.20 name its transfer bound ``transfer_layer_num``);
- ``load_fence`` (0.5.19+) and ``write_fence`` (0.5.23): ``load_fence_stream`` /
  ``write_fence_stream``; with both, the shape has capability ``fence_streams``;
- ``done_event`` (0.5.22+): the allocator's ``set_hicache_transfer_done_event``, with deferred
  page reuse modelled by ``L2AllocatorShim``.

Imports that moved between releases (``memory_pool_host`` -> ``pool_host/`` in 0.5.14, the
pipeline-rank helpers of 0.5.13 - 0.5.15, ``runtime_context.get_parallel`` from 0.5.16) are
served by ``install_stubs`` for every tree.

Releases that share a shape (``ReleaseShape.label``): 0.5.10, 0.5.10.post1 (``streams``);
0.5.11 - 0.5.17 with their post releases (``streams+draft``); 0.5.18 (``l2-v1+draft``); 0.5.19,
0.5.20 (``l2-v1+hybrid+load_fence``); 0.5.21 (``l2-v2+hybrid+load_fence``); 0.5.22
(``l2-v2+done_event+hybrid+load_fence``); 0.5.23 (``l2-v2+done_event+hybrid+load_fence+
write_fence``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH

Engine = Literal["streams", "l2-v1", "l2-v2"]
L2_ENGINE_RELPATH = Path("sglang/srt/mem_cache/l2_transfer.py")
HYBRID_CONTROLLER_RELPATH = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py")

FEATURE_PATTERNS: dict[str, tuple[Path, str]] = {
    "draft": (CONTROLLER_RELPATH, r"def set_draft_kv_pool\("),
    "load_fence": (CONTROLLER_RELPATH, r"self\.load_fence_stream\b"),
    "write_fence": (CONTROLLER_RELPATH, r"self\.write_fence_stream\b"),
    "done_event": (CONTROLLER_RELPATH, r"\.set_hicache_transfer_done_event\("),
    "hybrid": (HYBRID_CONTROLLER_RELPATH, r"packed_draft_device_pools"),
}
"""Each feature, by the file and the name that introduces it."""


@dataclass(frozen=True)
class ReleaseShape:
    """What the gate must adapt for one tree: the copy engine and the controller's features."""

    engine: Engine
    features: frozenset[str]

    @property
    def label(self) -> str:
        """``engine+feature+...`` (features sorted), as the release matrix prints it."""
        return "+".join([self.engine, *sorted(self.features)])

    @property
    def has_evict_device(self) -> bool:
        return self.engine != "l2-v2"


def _read(tree: Path, relpath: Path) -> str:
    path = tree / relpath
    return path.read_text() if path.is_file() else ""


def detect_shape(tree: Path) -> ReleaseShape:
    """The shape of the controller in ``tree``, from its files."""
    engine_source = _read(tree, L2_ENGINE_RELPATH)
    engine: Engine = "streams"
    if engine_source:
        engine = "l2-v2" if "load_to_device_per_layer_physical" in engine_source else "l2-v1"
    features = frozenset(
        name
        for name, (relpath, pattern) in FEATURE_PATTERNS.items()
        if re.search(pattern, _read(tree, relpath))
    )
    return ReleaseShape(engine, features)


def is_l2_engine_tree(tree: Path) -> bool:
    """Whether the tree's controller drives transfers through ``L2TransferEngine`` (0.5.18+)."""
    return detect_shape(tree).engine != "streams"


# -- the shims ------------------------------------------------------------------------------
class L2V1HostPoolShim:
    """The host-pool names 0.5.18 - 0.5.20's ``L2TransferEngine`` calls, over this project's
    pool: the copies are this pool's own, and ``load_to_device_per_layer`` takes ``is_draft``
    (upstream's pools use it only to pick the draft's buffers, which here are the draft pool
    the transfer names). Everything else is the harness's pool itself."""

    storage_format_tag = None

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def load_to_device_per_layer(
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


class L2HostPoolShim(L2V1HostPoolShim):
    """The host-pool names 0.5.21+'s ``L2TransferEngine`` calls, over this project's pool.

    0.5.21 renamed the copy entry points (``*_physical``) and added a per-submission index hook;
    for a plain (non-compacting) pool upstream's own base class forwards them exactly like this.
    """

    @property
    def logical_size(self) -> int:
        return int(self._pool.size)

    def prepare_transfer_indices(self, host_indices: Any, device_indices: Any, io: str) -> Any:
        return host_indices, device_indices

    def backup_from_device_all_layer_physical(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: str
    ) -> None:
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

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
        self.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft
        )


def host_pool_shim(shape: ReleaseShape, pool: Any) -> Any:
    """``pool`` as the shape's transfer engine calls it (itself for the ``streams`` engine)."""
    if shape.engine == "l2-v2":
        return L2HostPoolShim(pool)
    if shape.engine == "l2-v1":
        return L2V1HostPoolShim(pool)
    return pool


class L2AllocatorShim:
    """This project's allocator with upstream's deferred page reuse (0.5.22+).

    The controller hands the allocator the finish event of its latest write and of its latest
    load (``set_hicache_transfer_done_event``, keyed ``(id, "write"|"load")``). Upstream's base
    allocator ignores them; its sub-pool allocator defers reuse instead of trusting the tree:
    a free first makes the current stream wait on every event recorded since the last free, so
    work queued after the free (another request's KV landing in the reused pages) runs after
    every copy issued before it. This shim does the same, then frees. The tree never frees
    pages a transfer still uses, so in campaigns the waits are satisfied already; the direct
    tests free pages under a queued copy.
    """

    def __init__(self, allocator: Any, device_module: Any) -> None:
        self._allocator = allocator
        self._device = device_module
        self.transfer_done_events: dict[object, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._allocator, name)

    def set_hicache_transfer_done_event(self, key: object, event: Any) -> None:
        self.transfer_done_events[key] = event

    def free(self, free_index: Any) -> None:
        """Order the current stream after the recorded copies, then free (deferred reuse)."""
        if self.transfer_done_events:
            stream = self._device.current_stream()
            for event in self.transfer_done_events.values():
                stream.wait_event(event)
            self.transfer_done_events.clear()
        self._allocator.free(free_index)


# -- draft pools ----------------------------------------------------------------------------
class AfterTargetForward:
    """How upstream orders a draft layer read after a load: the draft device pool has no layer
    counter of its own (upstream registers one on the target pool only), and the draft forward
    of a batch runs after the target forward of that batch on the same stream, whose reads
    waited for every target layer. So a draft read waits for the last target layer's event,
    which upstream records after every draft copy it issues within the target's layers."""

    def __init__(self, counter: Any, target_layer_num: int) -> None:
        self._counter = counter
        self._last_target_layer = target_layer_num - 1

    def wait_until(self, threshold: int) -> None:
        self._counter.wait_until(self._last_target_layer)


def wire_draft_pools(controller: Any, request: Any, shape: ReleaseShape) -> None:
    """Hand the harness's draft pool pair to a ``draft`` shape (``set_draft_kv_pool``: the draft
    copies reuse the target's host slots, as the harness's non-CP drafts do), and give the draft
    device pool upstream's read order (``AfterTargetForward``)."""
    assert request.draft_device_pool is not None and request.draft_host_pool is not None
    controller.set_draft_kv_pool(
        request.draft_device_pool, host_pool_shim(shape, request.draft_host_pool)
    )
    request.draft_device_pool.register_layer_transfer_counter(
        AfterTargetForward(controller.layer_done_counter, request.config.layer_num)
    )


def shape_capabilities(shape: ReleaseShape) -> frozenset[str]:
    """What a shape adds to the upstream contract: ``draft`` (``set_draft_kv_pool``) and
    ``fence_streams`` (both fences: the harness sets them to the forward's own stream)."""
    added = {"draft"} & shape.features
    if {"write_fence", "load_fence"} <= shape.features:
        added.add("fence_streams")
    return frozenset(added)
