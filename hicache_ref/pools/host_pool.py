"""Host KV pools: the host copy of a device pool, its slot allocator, transfers and page I/O.

Mirrors SGLang 0.5.10 ``memory_pool_host.py`` with these deliberate differences:

- slots are handed out and freed in whole aligned pages, checked on every call (INV-01), and a
  double free or a foreign slot is refused before anything changes (INV-05, INV-17; upstream 0.5.10
  has no check at all, bug class 14);
- one class serves every device pool kind: the host pool holds one buffer per component of its
  device pool, so the NSA indexer sidecar is moved with the KV (sglang#17085); the per-kind
  classes of ``host_pool_kinds`` only name those buffers;
- ``get_data_page`` / ``set_from_flat_data_page`` use one layout-independent byte order, so a page
  stored under one layout reads back under another (bug class 21; upstream's page bytes follow the
  buffer, e.g. ``(H, page, L, D)`` per K/V under ``page_head``);
- ``page_head`` (MHA only, as upstream) is refused at construction for MLA and NSA pools, and the
  fork-only ``layer_page_first`` is supported for every pool kind (see ``host_layout.py``);
- transfers are stream work launched through ``device_module.launch`` (see ``transfer.py``); a
  per-layer load or backup checks and plans its index pair on its first layer and reuses that
  for the pair's later layers (``layer_launch``);
- the size is not forced above the device pool's (tests use tiny pools).

Primitives in data-flow order: ``alloc`` -> ``backup_from_device_all_layer`` /
``backup_from_device_per_layer`` (d2h) -> ``get_data_page`` (to storage) ->
``set_from_flat_data_page`` (from storage) -> ``load_to_device_per_layer`` /
``load_to_device_layers`` (h2d) -> ``free``.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from hicache_ref.device.protocol import DeviceModule
from hicache_ref.errors import (
    DoubleFreeError,
    ForeignSlotError,
    HiCacheInputError,
    PageAlignmentError,
)
from hicache_ref.pools.allocator import pages_to_token_locs
from hicache_ref.pools.copy_choice import auto_triton_programs
from hicache_ref.pools.device_pool import (
    KVCache,
    MHATokenToKVPool,
)
from hicache_ref.pools.free_pages import PageFreeList
from hicache_ref.pools.host_layout import (
    HostLayout,
    check_host_layout,
    check_io_backend,
    check_layout_for_pool_kind,
    compute_host_buffer_shape,
    host_page_rows,
    host_row_index,
)
from hicache_ref.pools.layer_launch import LayerLaunch, LayerLaunches, PreparedPair
from hicache_ref.pools.page_index import (
    as_cpu_int64,
    check_index_tensor,
    get_small_cpu_values,
    validate_page_aligned_token_indices,
)
from hicache_ref.pools.page_math import compute_padded_len
from hicache_ref.pools.transfer import (
    CopyPath,
    Direction,
    PreparedTransfer,
    check_copy_path,
    prepare_transfer,
    resolve_copy_path,
)
from hicache_ref.pools.transfer_checks import check_transfer_layer
from hicache_ref.pools.triton_copy import TRITON_LAUNCH_DEFAULT, TritonLaunch


class HostKVCache:
    """The host copy of ``device_pool``: one buffer per component, in ``layout``."""

    device_pool_kind: ClassVar[type[KVCache] | None] = None
    """The exact device pool class a subclass serves (``None``: any)."""

    pool_kind: ClassVar[str | None] = None
    """The key of ``LAYOUTS_BY_POOL_KIND`` naming the layouts this class can take."""

    def __init__(
        self,
        device_pool: KVCache,
        host_to_device_ratio: float = 2.0,
        host_size: float = 0,
        page_size: int | None = None,
        layout: str = "layer_first",
        pin_memory: bool | None = None,
        device: str | torch.device = "cpu",
        *,
        size_tokens: int | None = None,
        alloc_policy: str = "fifo",
        seed: int = 0,
        copy_path: str = "auto",
        device_module: DeviceModule | None = None,
        triton_launch: TritonLaunch = TRITON_LAUNCH_DEFAULT,
    ) -> None:
        # Verify the exact device pool class: an MLA host pool on an NSA device pool would look
        # like it drops the index_k sidecar (sglang#17085)
        kind = self.device_pool_kind
        if kind is not None and type(device_pool) is not kind:
            raise HiCacheInputError(
                f"{type(self).__name__} needs a {kind.__name__}, got {type(device_pool).__name__}; "
                "use make_host_pool(device_pool, ...) to pick the matching host pool"
            )
        self.device_pool = device_pool
        # the device its copies launch on (default: the device pool's; a harness hands a view
        # that tags each copy with the rank and pool it belongs to)
        self.device_module: DeviceModule = device_module or device_pool.device_module
        self.layout: HostLayout = check_host_layout(layout)
        check_layout_for_pool_kind(
            self.layout, self._layout_pool_kind(device_pool), type(device_pool).__name__
        )
        self.layer_launches = LayerLaunches()
        """The prepared index pairs of per-layer transfers (``layer_launch``; dropped when
        ``copy_path`` or ``triton_launch`` is set, or the pool cleared)."""
        self._copy_path = check_copy_path(copy_path)
        # the launch shape of copy_path='triton' (auto sizes its own grid on page_first)
        self._triton_launch = triton_launch
        self.page_size = device_pool.page_size if page_size is None else page_size
        # Verify positive pages
        if self.page_size < 1:
            raise HiCacheInputError(f"page_size must be >= 1, got {self.page_size}")
        self.dtype = device_pool.dtype
        self.layer_num = device_pool.layer_num
        self.row_shapes = device_pool.component_row_shapes()
        self.size_per_token = device_pool.get_size_per_token()
        self.size = compute_padded_len(
            self._requested_size(host_to_device_ratio, host_size, size_tokens), self.page_size
        )
        self.num_pages = self.size // self.page_size
        self.device = torch.device(device)
        self.pin_memory = self.device_module.pin_memory if pin_memory is None else pin_memory
        # Verify pinning is possible (pinned memory needs a CUDA runtime)
        if self.pin_memory and not torch.cuda.is_available():
            raise HiCacheInputError(
                "pin_memory=True needs CUDA; pass pin_memory=False on a CPU-only machine"
            )
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.zeros(
                compute_host_buffer_shape(
                    self.layout, self.size, self.layer_num, self.page_size, row_shape
                ),
                dtype=self.dtype,
                device=self.device,
                pin_memory=self.pin_memory,
            )
            for name, row_shape in self.row_shapes.items()
        }
        self.lock = threading.RLock()
        self._free = PageFreeList(range(self.num_pages), alloc_policy=alloc_policy, seed=seed)
        self.alloc_policy = self._free.alloc_policy

    def _layout_pool_kind(self, device_pool: KVCache) -> str | None:
        """This class's ``pool_kind``; the generic class judges an MHA pool as ``mha``."""
        if self.pool_kind is None and isinstance(device_pool, MHATokenToKVPool):
            return "mha"
        return self.pool_kind

    def _requested_size(
        self, host_to_device_ratio: float, host_size: float, size_tokens: int | None
    ) -> int:
        """Tokens asked for: ``size_tokens``, else ``host_size`` GB, else ratio x device size."""
        if size_tokens is not None:
            requested = operator.index(size_tokens)
        elif host_size > 0:
            requested = int(host_size * 1e9) // self.size_per_token
        else:
            requested = int(self.device_pool.size * host_to_device_ratio)
        # Verify a non-negative size
        if requested < 0:
            raise HiCacheInputError(f"host pool size must be >= 0 tokens, got {requested}")
        return requested

    def component_names(self) -> tuple[str, ...]:
        """The components this pool holds (those of its device pool), in transfer order."""
        return tuple(self.buffers)

    @property
    def copy_path(self) -> CopyPath:
        """How transfers move bytes (``transfer.COPY_PATHS``); setting it drops the prepared
        per-layer transfers, so the next launch resolves and checks the new path."""
        return self._copy_path

    @copy_path.setter
    def copy_path(self, copy_path: str) -> None:
        self._copy_path = check_copy_path(copy_path)
        self.layer_launches.clear()

    @property
    def triton_launch(self) -> TritonLaunch:
        """The launch shape of ``copy_path='triton'``; setting it drops the prepared per-layer
        transfers (their kernels were built for the old shape)."""
        return self._triton_launch

    @triton_launch.setter
    def triton_launch(self, triton_launch: TritonLaunch) -> None:
        self._triton_launch = triton_launch
        self.layer_launches.clear()

    # ------------------------------------------------------------------ slots
    def available_size(self) -> int:
        """Free host slots (tokens)."""
        with self.lock:
            return self._free.count() * self.page_size

    def free_slot_count(self) -> int:
        """Free host slots (tokens); with ``allocated_pages`` it accounts for every slot (INV-05)."""
        return self.available_size()

    def allocated_pages(self) -> frozenset[int]:
        """Host pages handed out and not freed yet (kept by alloc and free, not recomputed)."""
        with self.lock:
            return self._free.taken_pages()

    def is_page_free(self, page: int) -> bool:
        """Whether host page ``page`` is free."""
        with self.lock:
            return self._free.is_free(page)

    def clear(self) -> None:
        """Free every slot (the byte contents are kept); the handout order restarts, and the
        prepared per-layer transfers are dropped."""
        with self.lock:
            self._free.reset()
        self.layer_launches.clear()

    def _check_need_size(self, need_size: int) -> int:
        need_size = operator.index(need_size)
        # Verify whole pages are asked for (INV-01)
        if need_size < 0 or need_size % self.page_size != 0:
            raise PageAlignmentError(
                f"INV-01: host alloc(need_size={need_size}) must ask for a non-negative multiple of "
                f"page_size={self.page_size}; round up with compute_padded_len"
            )
        return need_size // self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Slots of ``need_size // page_size`` whole pages (by policy), or ``None`` when short."""
        num_pages = self._check_need_size(need_size)
        with self.lock:
            pages = self._free.take(num_pages)
        return None if pages is None else pages_to_token_locs(pages, self.page_size)

    def alloc_contiguous_preferred(self, need_size: int) -> torch.Tensor | None:
        """Like ``alloc``, but the lowest run of consecutive free pages when one exists."""
        num_pages = self._check_need_size(need_size)
        with self.lock:
            run = self._free.find_free_run(num_pages) if num_pages > 0 else None
            if run is None:
                pages = self._free.take(num_pages)
            else:
                self._free.take_specific(run)
                pages = run
        return None if pages is None else pages_to_token_locs(pages, self.page_size)

    def free(self, indices: torch.Tensor) -> int:
        """Free whole pages of slots; returns the number of slots freed.

        Everything is checked before anything is freed (INV-01, INV-05), so a refused free
        changes nothing (INV-17).
        """
        check_index_tensor(indices, "host indices")
        # Host-side bookkeeping: a CUDA index tensor is copied to the host here (one sync, as upstream)
        slots = as_cpu_int64(indices)
        validate_page_aligned_token_indices(slots, self.page_size, "host indices to free")
        pages = [int(first) // self.page_size for first in slots[:: self.page_size].tolist()]
        with self.lock:
            self._check_pages_to_free(pages)
            self._free.push(pages)
        return int(indices.numel())

    def _check_pages_to_free(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for page in pages:
            # Verify the page belongs to this pool (INV-05)
            if not 0 <= page < self.num_pages:
                raise ForeignSlotError(
                    f"INV-05: host free got page {page} (slots {page * self.page_size}.."
                    f"{page * self.page_size + self.page_size - 1}), outside this pool's pages "
                    f"[0, {self.num_pages})"
                )
            # Verify the page is held, and listed once (INV-05)
            if self._free.is_free(page) or page in seen:
                raise DoubleFreeError(
                    f"INV-05: host free got page {page} (slots {page * self.page_size}.."
                    f"{page * self.page_size + self.page_size - 1}), which is free already or "
                    "listed twice; free each allocation exactly once"
                )
            seen.add(page)

    # ------------------------------------------------------------------ transfers
    def _check_device_pool(self, device_pool: KVCache) -> None:
        # Verify the device pool has this host pool's geometry (every component, same rows)
        if device_pool is self.device_pool:
            return  # its own device pool: checked at construction, and shapes never change
        if (
            device_pool.component_row_shapes() != self.row_shapes
            or device_pool.layer_num != self.layer_num
            or device_pool.dtype != self.dtype
        ):
            raise HiCacheInputError(
                f"device pool {type(device_pool).__name__} (components "
                f"{device_pool.component_row_shapes()}, layers {device_pool.layer_num}, "
                f"{device_pool.dtype}) does not match this host pool (components {self.row_shapes}, "
                f"layers {self.layer_num}, {self.dtype})"
            )

    def _prepare(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        direction: Direction,
        io_backend: str,
    ) -> PreparedTransfer:
        """Check and plan a transfer between this pool and ``device_pool`` (any layers)."""
        backend = check_io_backend(io_backend, self.layout)
        self._check_device_pool(device_pool)
        return prepare_transfer(
            device_pool=device_pool,
            host_buffers=self.buffers,
            layout=self.layout,
            page_size=self.page_size,
            host_size=self.size,
            direction=direction,
            io_backend=backend,
            host_indices=host_indices,
            device_indices=device_indices,
            copy_path=self._copy_path,
            host_pinned=self.pin_memory,
            triton=self._triton_launch,
        )

    def _layer_launch(
        self,
        pair: PreparedPair | None,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        direction: Direction,
        io_backend: str,
    ) -> LayerLaunch:
        """A layer not launched from ``pair`` yet: checked, then built from the pair (prepared
        here on the pair's first layer, ``layer_launch``)."""
        layer = check_transfer_layer(device_pool, layer_id)
        return self.layer_launches.build(
            pair,
            device_pool,
            host_indices,
            device_indices,
            io_backend,
            layer,
            lambda: self._prepare(device_pool, host_indices, device_indices, direction, io_backend),
        )

    def chosen_copy_path(self, device_pool: KVCache | None = None) -> CopyPath:
        """The copy path transfers with ``device_pool`` (default: this pool's own) take:
        ``copy_path``, or with ``auto`` what ``auto_copy_path`` says."""
        if self.copy_path != "auto":
            return self.copy_path
        return self.auto_copy_path(device_pool)

    def auto_copy_path(self, device_pool: KVCache | None = None) -> CopyPath:
        """What ``copy_path="auto"`` takes between this pool and ``device_pool`` (default: its
        own) on this machine (``copy_choice``; CPU index tensors assumed), for reports."""
        pool = self.device_pool if device_pool is None else device_pool
        return resolve_copy_path(
            "auto",
            device_pool=pool,
            host_buffers=self.buffers,
            layout=self.layout,
            page_size=self.page_size,
            all_cpu=pool.device.type == "cpu" and self.device.type == "cpu",
            host_pinned=self.pin_memory,
        )

    def describe_auto_copy_path(self, device_pool: KVCache | None = None) -> str:
        """``auto_copy_path`` for reports, with the Triton programs per component where
        ``auto`` sizes its own grid (``copy_choice.auto_triton_programs``), e.g.
        ``triton 16/component``."""
        path = self.auto_copy_path(device_pool)
        programs = auto_triton_programs(self.layout)
        return f"{path} {programs}/component" if path == "triton" and programs else path

    def backup_from_device_all_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """Launch the d2h of every layer and component: ``host[h[i]] = device[d[i]]``."""
        prepared = self._prepare(device_pool, host_indices, device_indices, "d2h", io_backend)
        layers = tuple(range(self.layer_num))
        self.device_module.launch(
            prepared.closure(layers),
            label="d2h all layers",
            kind="copy",
            meta=prepared.meta(layers),
        )

    def backup_from_device_per_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """Launch the d2h of one local layer, every component (the fork's per-layer write-back);
        the pair is checked once, on its first layer (``layer_launch``)."""
        pair = self.layer_launches.current(
            device_pool, host_indices, device_indices, "d2h", io_backend
        )
        launch = None if pair is None else pair.layers.get(layer_id)
        if launch is None:
            launch = self._layer_launch(
                pair, device_pool, host_indices, device_indices, layer_id, "d2h", io_backend
            )
        self.device_module.launch(launch.fn, label=launch.label, kind="copy", meta=launch.meta)

    def load_to_device_per_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """Launch the h2d of one local layer, every component: ``device[d[i]] = host[h[i]]``.

        The pair is checked and planned on its first layer; a later layer of the same tensors,
        unchanged in place, is one lookup and the launch (``layer_launch``)."""
        pair = self.layer_launches.current(
            device_pool, host_indices, device_indices, "h2d", io_backend
        )
        launch = None if pair is None else pair.layers.get(layer_id)
        if launch is None:
            launch = self._layer_launch(
                pair, device_pool, host_indices, device_indices, layer_id, "h2d", io_backend
            )
        self.device_module.launch(launch.fn, label=launch.label, kind="copy", meta=launch.meta)

    def load_to_device_layers(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_ids: Sequence[int],
        io_backend: str,
        after_layer: Callable[[int], None],
    ) -> None:
        """``load_to_device_per_layer(layer)`` then ``after_layer(layer)`` (e.g. record its
        event) for each of ``layer_ids`` in order. On a device that runs a launch at once
        (``launches_directly``: a GPU) with the ``batch`` path, the layers are one stepped
        entry of the copy engine's issuing thread, the current stream waiting for each before
        its ``after_layer`` (``CudaBatchCopier.issue_rows_stepped``). The checks are the
        per-layer path's (the pair planned with the first layer, every layer checked)."""
        ids = [operator.index(layer) for layer in layer_ids]
        if not ids:
            return
        layers = [check_transfer_layer(device_pool, layer) for layer in ids]
        if (
            getattr(self.device_module, "launches_directly", False)
            and layers == ids  # local ids: a stepped entry's rows are the pool's layers
            and ids == list(range(ids[0], ids[0] + len(ids)))
        ):
            pair = self.layer_launches.current(
                device_pool, host_indices, device_indices, "h2d", io_backend
            )
            if pair is None:
                self._layer_launch(
                    None, device_pool, host_indices, device_indices, layers[0], "h2d", io_backend
                )
                pair = self.layer_launches.current(
                    device_pool, host_indices, device_indices, "h2d", io_backend
                )
            stepped = None if pair is None else pair.prepared.stepped
            if pair is not None and stepped is not None:
                run = tuple(ids)
                self.device_module.launch(
                    functools.partial(stepped, run, after_layer),
                    label=f"h2d layers {run[0]}-{run[-1]}",
                    kind="copy",
                    meta=pair.prepared.meta(run),
                )
                return
        for layer in ids:
            self.load_to_device_per_layer(
                device_pool, host_indices, device_indices, layer, io_backend
            )
            after_layer(layer)

    # ------------------------------------------------------------------ storage pages
    def _check_page_start(self, index: int | torch.Tensor) -> int:
        start = int(index)
        # Verify a page start inside the pool (INV-01)
        if start % self.page_size != 0:
            raise PageAlignmentError(
                f"INV-01: page index {start} is not a page start; use a multiple of page_size={self.page_size}"
            )
        if not 0 <= start < self.size:
            raise HiCacheInputError(
                f"page index {start} is outside this host pool's slots [0, {self.size})"
            )
        return start

    def get_flat_page_numel(self) -> int:
        """Elements in one flat page: every layer and component of ``page_size`` tokens."""
        per_token = sum(math.prod(shape) for shape in self.row_shapes.values())
        return per_token * self.layer_num * self.page_size

    def get_data_page(self, index: int | torch.Tensor, flat: bool = True) -> torch.Tensor:
        """A copy of the page starting at slot ``index``, all layers and components.

        ``flat=True``: 1-D, component by component, each ``(layer, token, *row)`` in order: the
        same bytes for every layout. ``flat=False``: ``(components, L, page, *row)``, only when all
        components share one row shape (not NSA).
        """
        start = self._check_page_start(index)
        with self.lock:
            pages = [
                host_page_rows(self.layout, self.buffers[name], start, self.page_size)
                for name in self.buffers
            ]
            if flat:
                return torch.cat([page.reshape(-1) for page in pages]).cpu()
            if len(set(self.row_shapes.values())) != 1:
                raise HiCacheInputError(
                    f"get_data_page(flat=False) needs one row shape for all components, got "
                    f"{self.row_shapes}; use flat=True"
                )
            return torch.stack(pages).cpu()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero flat page of the right size and dtype (a landing buffer for storage reads)."""
        return torch.zeros(self.get_flat_page_numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int | torch.Tensor, data_page: torch.Tensor) -> None:
        """Write a flat page (``get_data_page`` order) into the page starting at slot ``index``."""
        start = self._check_page_start(index)
        # Verify the page has the flat size and dtype of this pool
        if data_page.numel() != self.get_flat_page_numel() or data_page.dtype != self.dtype:
            raise HiCacheInputError(
                f"a flat data page must have {self.get_flat_page_numel()} elements of {self.dtype}, "
                f"got {data_page.numel()} of {data_page.dtype}"
            )
        # a gated storage thread (the harness's schedule points) parks here before the bytes
        # are set; any other thread has no ``park_at_point`` and passes
        park = getattr(threading.current_thread(), "park_at_point", None)
        if park is not None:
            park("page_write", f"slot {start}")
        flat = data_page.reshape(-1)
        offset = 0
        with self.lock:
            for buffer in self.buffers.values():
                page = host_page_rows(self.layout, buffer, start, self.page_size)
                page.copy_(flat[offset : offset + page.numel()].view(page.shape))
                offset += page.numel()

    # ------------------------------------------------------------------ harness access
    def _host_key(
        self, component: str, layer_id: int, host_indices: torch.Tensor
    ) -> tuple[torch.Tensor | int | slice, ...]:
        if component not in self.buffers:
            raise HiCacheInputError(
                f"unknown component {component!r}; this pool has {self.component_names()}"
            )
        layer = self.device_pool.check_layer_id(layer_id)
        check_index_tensor(host_indices, "host_indices")
        slots = as_cpu_int64(host_indices)
        values = get_small_cpu_values(slots)
        if values is None:
            values = [int(slots.min()), int(slots.max())] if slots.numel() else []
        if values and (min(values) < 0 or max(values) >= self.size):
            raise HiCacheInputError(f"host_indices must lie in [0, {self.size})")
        return host_row_index(self.layout, layer, slots, self.page_size)

    def read_rows(self, component: str, layer_id: int, host_indices: torch.Tensor) -> torch.Tensor:
        """A CPU copy of rows ``(n, *row)`` (synchronous; for tests and checkers only)."""
        key = self._host_key(component, layer_id, host_indices)
        return self.buffers[component][key].cpu()

    def write_rows(
        self, component: str, layer_id: int, host_indices: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Overwrite rows synchronously (for tests and checkers only)."""
        key = self._host_key(component, layer_id, host_indices)
        self.buffers[component][key] = values.to(device=self.device, dtype=self.dtype)
