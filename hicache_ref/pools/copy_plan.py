"""Copy plans: a transfer's index pairs as byte offsets, built once and reused for every layer.

A host row of every layout is an affine function of its slot ``s`` and layer ``l``, in elements
of the component's buffer (``HostRowGeometry``):

    layer_base(l) + (s // page) * page_stride + (s % page) * slot_stride + j * piece_stride

for pieces ``j < piece_num`` of ``piece_numel`` contiguous elements. Every layout but
``page_head`` has one piece, the whole row; ``page_head`` rows are ``H`` pieces of ``head_dim``
elements, one per head, ``page * L * head_dim`` apart. A device row is ``loc * row_numel``, one
contiguous piece.

``plan_row_runs`` merges the index pairs (in the order given, like ``plan_copy_runs``) into runs
of rows that are consecutive in memory on both sides: under ``layer_first`` and
``layer_page_first`` consecutive slots are adjacent even across pages, under
``page_first_direct`` only inside one host page, under ``page_first`` never (the layers of one
slot sit between two slots), so ``page_first`` plans one copy per token row. ``page_head`` has
no plan of whole rows (a row is ``H`` pieces of ``head_dim`` elements, 256 bytes for bf16 heads
of 128): the copy engine refuses it and the Triton kernel moves it piece by piece.

``plan_component_copies`` turns the runs into byte offsets per component (once per transfer),
and ``build_descriptor_table`` adds every layer's base addresses at once (one broadcast add per
component and side): the ``[layers, copies]`` destination and source arrays that each layer's
``cudaMemcpyBatchAsync`` (or ``memmove``) reads as one row, with one sizes array for all.
``PlanCache`` keeps the plans of the last few index tensors, keyed by tensor identity and
version, so the per-layer loads of one batch (same index tensors, one launch per layer) plan
and validate once.

The per-transfer math (``plan_row_runs``, ``build_descriptor_table``) runs in numpy, not torch:
torch splits a CPU op of 32,768 elements or more (a 32k-token load; 61 layers of 512 copies)
over its intra-op threads, and waking them costs the calling thread milliseconds on every load
whose pool threads slept since the last one; numpy runs it on the caller (issue 30).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.pools.host_layout import HostLayout

PLAN_CACHE_ENTRIES_MAX = 8
"""Plans kept per process (each holds its index tensors alive)."""


@dataclass(frozen=True)
class HostRowGeometry:
    """Where host rows of one component live, in elements of its buffer (see module doc)."""

    layer_stride: int
    page_stride: int
    slot_stride: int
    piece_stride: int
    piece_num: int
    piece_numel: int
    page_size: int

    def slot_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Element offsets of piece 0 of each slot, relative to the layer base (int64)."""
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        return pages * self.page_stride + (slots - pages * self.page_size) * self.slot_stride

    def slot_offsets_np(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``slot_offsets`` of CPU slots, in numpy (on the calling thread: see the module doc)."""
        pages, within = np.divmod(slots, self.page_size)
        offsets: npt.NDArray[np.int64] = pages * self.page_stride + within * self.slot_stride
        return offsets


def compute_host_row_geometry(
    layout: HostLayout, size: int, layer_num: int, page_size: int, row_shape: tuple[int, ...]
) -> HostRowGeometry:
    """The ``HostRowGeometry`` of a buffer shaped by ``compute_host_buffer_shape``."""
    assert size % page_size == 0
    row = math.prod(row_shape)
    if layout == "page_head":
        head_num, head_dim = row_shape
        return HostRowGeometry(
            layer_stride=head_dim,
            page_stride=head_num * page_size * layer_num * head_dim,
            slot_stride=layer_num * head_dim,
            piece_stride=page_size * layer_num * head_dim,
            piece_num=head_num,
            piece_numel=head_dim,
            page_size=page_size,
        )
    strides = {
        "layer_first": (size, page_size, 1),
        "page_first": (1, page_size * layer_num, layer_num),
        "page_first_direct": (page_size, layer_num * page_size, 1),
        "layer_page_first": (size, page_size, 1),
    }[layout]
    layer_stride, page_stride, slot_stride = (stride * row for stride in strides)
    return HostRowGeometry(
        layer_stride=layer_stride,
        page_stride=page_stride,
        slot_stride=slot_stride,
        piece_stride=row,
        piece_num=1,
        piece_numel=row,
        page_size=page_size,
    )


@dataclass(frozen=True)
class RowRuns:
    """Runs of rows consecutive on both sides, in row units (component independent)."""

    host_rows: torch.Tensor
    """First host row of each run, relative to the layer base, in rows of ``row_numel``."""
    device_rows: torch.Tensor
    """First device loc of each run."""
    lengths: torch.Tensor
    """Rows in each run (>= 1)."""


def plan_row_runs(geometry: HostRowGeometry, host: torch.Tensor, device: torch.Tensor) -> RowRuns:
    """Merge index pairs into runs that are contiguous in memory on both sides (one piece rows)."""
    assert geometry.piece_num == 1
    assert host.numel() == device.numel()
    if host.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return RowRuns(empty, empty, empty)
    # numpy on the calling thread (the module doc says why); the tensors share its arrays
    host_np = host.to(torch.int64).numpy()
    device_np = device.to(torch.int64).numpy()
    host_rows = geometry.slot_offsets_np(host_np) // geometry.piece_numel
    starts_run = np.ones(host_np.size, dtype=np.bool_)
    starts_run[1:] = (host_rows[1:] != host_rows[:-1] + 1) | (device_np[1:] != device_np[:-1] + 1)
    starts = np.flatnonzero(starts_run)
    lengths = np.diff(starts, append=host_np.size)
    return RowRuns(
        torch.from_numpy(host_rows[starts]),
        torch.from_numpy(device_np[starts]),
        torch.from_numpy(lengths.astype(np.int64, copy=False)),
    )


@dataclass(frozen=True)
class ComponentCopies:
    """One component's copies of one transfer, as byte offsets from the per-layer bases."""

    name: str
    host_offsets: torch.Tensor
    device_offsets: torch.Tensor
    sizes: torch.Tensor
    host_layer_stride_bytes: int
    host_extent_bytes: int
    """Max ``offset + size`` on the host side (0 when empty), for the bounds check."""
    device_extent_bytes: int


def plan_component_copies(
    name: str, runs: RowRuns, geometry: HostRowGeometry, element_size: int
) -> ComponentCopies:
    """Byte offsets of ``runs`` for one component (rows of ``geometry.piece_numel`` elements)."""
    row_bytes = geometry.piece_numel * element_size
    sizes = runs.lengths * row_bytes
    host_offsets = runs.host_rows * row_bytes
    device_offsets = runs.device_rows * row_bytes
    empty = sizes.numel() == 0
    return ComponentCopies(
        name=name,
        host_offsets=host_offsets,
        device_offsets=device_offsets,
        sizes=sizes,
        host_layer_stride_bytes=geometry.layer_stride * element_size,
        host_extent_bytes=0 if empty else int((host_offsets + sizes).max()),
        device_extent_bytes=0 if empty else int((device_offsets + sizes).max()),
    )


def check_copies_in_bounds(
    copies: ComponentCopies,
    *,
    host_buffer: torch.Tensor,
    device_buffer_nbytes: int,
    layer_id: int,
) -> None:
    """Raise unless every copy of ``layer_id`` stays inside its two buffers (a planner bug would
    otherwise write through a wild pointer)."""
    host_nbytes = host_buffer.numel() * host_buffer.element_size()
    host_end = layer_id * copies.host_layer_stride_bytes + copies.host_extent_bytes
    # Verify the plan addresses only rows of the two buffers (INV-06: no byte lands elsewhere)
    if host_end > host_nbytes or copies.device_extent_bytes > device_buffer_nbytes:
        raise InvariantViolation(
            "INV-06",
            f"a copy plan of component {copies.name!r} layer {layer_id} reaches host byte "
            f"{host_end} of {host_nbytes} / device byte {copies.device_extent_bytes} of "
            f"{device_buffer_nbytes} (the planner is wrong; use copy_path='runs')",
        )


@dataclass(frozen=True)
class DescriptorTable:
    """Every layer's copies of one transfer and direction: row ``l`` of ``dsts`` / ``srcs`` is
    layer ``l``'s batch (components concatenated in order), ``sizes`` is shared by all rows."""

    dsts: torch.Tensor
    srcs: torch.Tensor
    sizes: torch.Tensor
    device_bases: tuple[tuple[int, ...], ...]
    """Per layer, each component's device buffer address the rows were built from."""


def build_descriptor_table(
    copies: list[ComponentCopies],
    *,
    host_bases: list[int],
    device_bases: list[list[int]],
    d2h: bool,
) -> DescriptorTable:
    """The ``DescriptorTable`` of ``copies`` (one per component) for layers ``0 ..
    len(device_bases) - 1``: ``host_bases[c]`` is component ``c``'s host buffer address,
    ``device_bases[l][c]`` its device buffer of layer ``l``. Vectorized: no loop per copy or
    layer."""
    layers = len(device_bases)
    layer_ids = np.arange(layers, dtype=np.int64)[:, None]
    device = np.array(device_bases, dtype=np.int64).reshape(layers, len(copies))
    host_rows = [
        c.host_offsets.numpy()[None, :] + (host_bases[k] + layer_ids * c.host_layer_stride_bytes)
        for k, c in enumerate(copies)
    ]
    device_rows = [
        c.device_offsets.numpy()[None, :] + device[:, k : k + 1] for k, c in enumerate(copies)
    ]
    # numpy on the calling thread (the module doc says why); the tensors share its arrays
    host_table = torch.from_numpy(np.ascontiguousarray(np.concatenate(host_rows, axis=1)))
    device_table = torch.from_numpy(np.ascontiguousarray(np.concatenate(device_rows, axis=1)))
    sizes = torch.cat([c.sizes for c in copies]).contiguous()
    dsts, srcs = (host_table, device_table) if d2h else (device_table, host_table)
    bases = tuple(tuple(row) for row in device_bases)
    return DescriptorTable(dsts=dsts, srcs=srcs, sizes=sizes, device_bases=bases)


def check_contiguous(tensor: torch.Tensor, what: str) -> None:
    """Pointer arithmetic needs dense row-major buffers."""
    # Verify the buffer is contiguous (offsets assume the row-major layout of its shape)
    if not tensor.is_contiguous():
        raise HiCacheInputError(
            f"{what} is not contiguous; copy_path='batch' and 'triton' compute addresses from "
            "the layout's shape, use copy_path='runs' for strided buffers"
        )


def read_versions(
    host_indices: torch.Tensor, device_indices: torch.Tensor
) -> tuple[int, int] | None:
    """Both tensors' in-place versions (every in-place write bumps one), or ``None`` where one
    has none (a tensor made under ``torch.inference_mode``: never cached)."""
    try:
        return host_indices._version, device_indices._version
    except RuntimeError:
        return None


@dataclass
class _CacheEntry:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    host_version: int
    device_version: int
    value: object


class PlanCache:
    """The last ``PLAN_CACHE_ENTRIES_MAX`` plans, keyed by the index tensors' identity and
    in-place version plus a geometry key; a hit means the same values were validated before."""

    def __init__(self, entries_max: int = PLAN_CACHE_ENTRIES_MAX) -> None:
        assert entries_max >= 1
        self.entries_max = entries_max
        self._entries: OrderedDict[tuple[int, int, Hashable], _CacheEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, key: Hashable
    ) -> object | None:
        """The cached value, or ``None`` (also when a tensor changed in place)."""
        full_key = (id(host_indices), id(device_indices), key)
        with self._lock:
            return self._get(full_key, host_indices, device_indices)

    def _get(
        self,
        full_key: tuple[int, int, Hashable],
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
    ) -> object | None:
        entry = self._entries.get(full_key)
        if (
            entry is None
            or entry.host_indices is not host_indices
            or entry.device_indices is not device_indices
            or read_versions(host_indices, device_indices)
            != (entry.host_version, entry.device_version)
        ):
            self.misses += 1
            return None
        self._entries.move_to_end(full_key)
        self.hits += 1
        return entry.value

    def put(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, key: Hashable, value: object
    ) -> None:
        """Remember ``value`` for these tensors (drops the oldest entry past the bound; nothing
        for tensors without a version counter)."""
        versions = read_versions(host_indices, device_indices)
        if versions is None:
            return
        full_key = (id(host_indices), id(device_indices), key)
        entry = _CacheEntry(host_indices, device_indices, *versions, value)
        with self._lock:
            self._entries[full_key] = entry
            self._entries.move_to_end(full_key)
            while len(self._entries) > self.entries_max:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every plan (a test or benchmark that wants the first-call cost again)."""
        with self._lock:
            self._entries.clear()
