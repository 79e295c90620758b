"""A Triton gather/scatter kernel between a (pinned) host pool and a device pool, zero-copy.

The kernel reads or writes the host buffer directly through unified addressing (a pinned
buffer's host address is valid on the GPU), so no staging buffer and no copy engine is used; it
costs SMs instead. A persistent grid of ``grid`` programs (over all components of the launch:
MHA's K and V share one launch and split the programs) walks the index pairs in tiles of
``rows`` pairs (tile ``t = pid, pid + grid, ...``); each pair moves one token row of one layer
as ``piece_num`` contiguous vectors of 4-byte words (one piece per row, or one per head under
``page_head``), addressed by ``HostRowGeometry``. Index tensors are read on the device when the
kernel runs.

Why tiles: a zero-copy read of host memory waits a PCIe round trip (~1-2 us), so a program
that moves one 1 KB row at a time keeps ~1 KB in flight and 8 programs move ~5 GB/s whatever
the link can do. A tile of ``rows`` rows issues all its loads before its first store, so the
bytes in flight grow with ``grid * rows``; offsets carry a 16-byte alignment hint (``VEC``
words) where every stride allows it, so the loads are 16-byte vectors.

Its ceiling is the link's, for SMs: they reach host memory in 128-byte PCIe reads and writes
where the copy engine uses 256-byte ones, so on an H200's Gen5 x16 the kernel tops out at ~92%
of a pinned copy-engine copy whatever the grid, tile or index order (PCIe counters and sweeps in
benchmarks/RESULTS.md); ``batch`` is the path to the link where its copies are large enough.

``prepare_row_copy`` does the per-transfer work once (word views, strides, the launch's
constant arguments) and returns one closure per layer; the closure is the whole per-layer
issue cost. The integer arguments are not specialized (``INT_ARGUMENTS``), so after the first
launch through Triton's JIT the compiled kernel is called directly (``RowCopyKernel.runners``, keyed by the
constants, grid and pointer alignments its compilation depends on), skipping the JIT's
dispatch. The launch shape is configuration passed down explicitly (``TritonLaunch``: a host
pool's ``triton_launch``, then ``launch_transfer``'s ``triton``), never a module-level setting.

On the CPU (``SimDevice``) the same kernel runs under Triton's interpreter when Triton is
installed, so the differential tests can compare it with the gather path; ``is_triton_available``
says whether it can run at all. Triton is optional: its source lives in ``triton_kernel``, which
``_kernel`` imports on first use.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools.copy_plan import HostRowGeometry

TRITON_GRID_DEFAULT = 8
"""Programs of the persistent grid: with 32-row tiles, 8 programs (8 of an H200's 132 SMs)
move what 132 do (benchmarks/RESULTS.md), and leave the rest to the forward pass."""
TRITON_ROWS_DEFAULT = 32
"""Index pairs per tile (see the module doc): 16 left 8 programs at 71-81% of the link."""
TRITON_WARPS_DEFAULT = 8
"""Warps per program."""
VECTOR_BYTES = 16
"""The widest load or store the hint asks for."""


def _check_power_of_two(what: str, value: int, at_most: int) -> None:
    # Verify a power of two Triton can compile (tl.arange and num_warps need one)
    if value < 1 or value & (value - 1) or value > at_most:
        raise HiCacheInputError(
            f"triton {what} must be a power of two in 1..{at_most}, got {value}"
        )


@dataclass(frozen=True)
class TritonTile:
    """How one program moves its pairs: ``rows`` pairs per tile, ``warps`` warps."""

    rows: int = TRITON_ROWS_DEFAULT
    warps: int = TRITON_WARPS_DEFAULT

    def __post_init__(self) -> None:
        _check_power_of_two("tile rows", self.rows, 256)
        _check_power_of_two("warps", self.warps, 32)


@dataclass(frozen=True)
class TritonLaunch:
    """The launch shape of ``copy_path='triton'``: ``grid`` programs per kernel (shared by a
    launch's components), each moving ``tile``. ``auto`` on ``page_first`` sizes its own grid
    per component (``copy_choice.auto_triton_programs``) and keeps the tile."""

    grid: int = TRITON_GRID_DEFAULT
    tile: TritonTile = TritonTile()

    def __post_init__(self) -> None:
        # Verify a positive grid
        if self.grid < 1:
            raise HiCacheInputError(f"triton grid must be >= 1 programs, got {self.grid}")


TRITON_LAUNCH_DEFAULT = TritonLaunch()


@functools.cache
def is_triton_available() -> bool:
    """Whether ``import triton`` can work in this environment (looked up once: the lookup
    walks ``sys.path``, tens of us on the issue path)."""
    return importlib.util.find_spec("triton") is not None


def _spans(geometry: HostRowGeometry) -> tuple[int, ...]:
    return (
        geometry.piece_numel,
        geometry.layer_stride,
        geometry.page_stride,
        geometry.slot_stride,
        geometry.piece_stride,
    )


def compute_word_dtype(geometry: HostRowGeometry, element_size: int) -> torch.dtype:
    """The widest word (4, 2 or 1 bytes) that divides every piece and stride of ``geometry``."""
    for word, dtype in ((4, torch.int32), (2, torch.int16)):
        if all(span * element_size % word == 0 for span in _spans(geometry)):
            return dtype
    return torch.uint8


def compute_vector_words(geometry: HostRowGeometry, element_size: int, word_size: int) -> int:
    """Words per 16-byte vector when every piece, stride and device row keeps that alignment
    (then every row offset is a multiple of it), else 1 (no hint)."""
    vector = VECTOR_BYTES // word_size
    spans = (*_spans(geometry), geometry.piece_numel * geometry.piece_num)
    if all(span * element_size % VECTOR_BYTES == 0 for span in spans):
        return vector
    return 1


def as_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous buffer reinterpreted as a flat vector of ``dtype`` words (a view)."""
    return tensor.reshape(-1).view(torch.uint8).view(dtype)


def _words(count_elements: int, element_size: int, word_size: int) -> int:
    return count_elements * element_size // word_size


INT_ARGUMENTS = (
    "n",
    "host_layer_base",
    "page_size",
    "page_stride",
    "slot_stride",
    "piece_stride",
    "device_row_stride",
    "host_component_delta",
    "device_component_delta",
)
"""Not specialized on their values, so one compiled kernel serves every layer and transfer (an
integer's width still is: ``_int_widths`` keys the runners on it)."""


@dataclass(frozen=True)
class RowCopyKernel:
    """The jitted kernel and, on the GPU, its compiled runners: each bound to its grid, by
    everything its compilation depends on (filled by the first launch of each)."""

    jitted: Any
    runners: dict[tuple[object, ...], Callable[..., None]] = field(default_factory=dict)


@functools.cache
def _kernel(interpret: bool) -> RowCopyKernel:
    """The process's kernel (compiled for the GPU, or wrapped by Triton's interpreter)."""
    from hicache_ref.pools.triton_kernel import paged_row_copy  # imports Triton

    if interpret:
        interpreter = importlib.import_module("triton.runtime.interpreter")
        return RowCopyKernel(interpreter.InterpretedFunction(paged_row_copy))
    triton = importlib.import_module("triton")
    return RowCopyKernel(triton.jit(paged_row_copy, do_not_specialize=INT_ARGUMENTS))


def _alignment_key(*tensors: torch.Tensor) -> tuple[bool, ...]:
    # Triton specializes a pointer on 16-byte alignment: a runner is reused only when it matches
    return tuple(tensor.data_ptr() % 16 == 0 for tensor in tensors)


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _int_widths(*values: int) -> tuple[bool, ...]:
    # Triton types an unspecialized int as i32 or i64 by its value: a runner compiled for i32
    # must never receive a value past it
    return tuple(INT32_MIN <= value <= INT32_MAX for value in values)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_WORD_SIZES = {torch.int32: 4, torch.int16: 2, torch.uint8: 1}


def component_deltas(buffers: Sequence[torch.Tensor], word_size: int) -> int | None:
    """Words from component 0's buffer to component 1's (0 for one component), or ``None`` when
    the components cannot share one launch (more than two, or not a whole number of words)."""
    if len(buffers) == 1:
        return 0
    if len(buffers) != 2:
        return None
    delta = buffers[1].data_ptr() - buffers[0].data_ptr()
    return delta // word_size if delta % VECTOR_BYTES == 0 else None


def prepare_row_copy(
    *,
    host_buffers: Sequence[torch.Tensor],
    device_buffers: Sequence[Sequence[torch.Tensor]],
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    geometry: HostRowGeometry,
    layer_ids: Sequence[int],
    d2h: bool,
    grid: int | None = None,
    tile: TritonTile | None = None,
) -> list[Callable[[], None]]:
    """One launch closure per layer; each runs on the current stream and moves every component
    of ``host_buffers`` (one or two sharing ``geometry``: MHA's K and V go in one launch, axis 1
    of the grid). ``device_buffers[k][c]`` is component ``c``'s device buffer of layer
    ``layer_ids[k]``. The indices must be on the device that runs the kernel: CUDA for a CUDA
    pool, CPU for the interpreter."""
    programs = TRITON_GRID_DEFAULT if grid is None else grid
    shape = TritonTile() if tile is None else tile
    # Verify a positive grid and a pair per index
    if programs < 1:
        raise HiCacheInputError(f"triton grid must be >= 1 programs, got {programs}")
    assert host_indices.numel() == device_indices.numel()
    assert len(device_buffers) == len(layer_ids)
    assert all(len(layer) == len(host_buffers) for layer in device_buffers)
    n = host_indices.numel()
    if n == 0:
        return [lambda: None for _ in layer_ids]
    element_size = host_buffers[0].element_size()
    word = compute_word_dtype(geometry, element_size)
    word_size = _WORD_SIZES[word]
    host_delta = component_deltas(host_buffers, word_size)
    assert host_delta is not None, "group components with component_deltas first"
    piece_words = _words(geometry.piece_numel, element_size, word_size)
    on_gpu = bool(device_buffers) and device_buffers[0][0].is_cuda
    kernel = _kernel(not on_gpu)
    components = len(host_buffers)
    # the grid is the launch's whole block budget: two components share it
    grid_size = max(1, min(programs // components, -(-n // shape.rows)))
    launch: Callable[..., Any] = kernel.jitted[(grid_size, components)]
    host_words = as_words(host_buffers[0], word)
    strides = (
        geometry.page_size,
        _words(geometry.page_stride, element_size, word_size),
        _words(geometry.slot_stride, element_size, word_size),
        _words(geometry.piece_stride, element_size, word_size),
        piece_words * geometry.piece_num,
    )
    constants: dict[str, Any] = {
        "PIECE_NUM": geometry.piece_num,
        "PIECE_WORDS": piece_words,
        "BLOCK": _next_power_of_two(piece_words),
        "ROWS": shape.rows,
        "VEC": compute_vector_words(geometry, element_size, word_size),
        "D2H": d2h,
    }
    if on_gpu:
        constants["num_warps"] = shape.warps
    constant_values = tuple(v for k, v in constants.items() if k != "num_warps")
    device_index = device_buffers[0][0].device.index if on_gpu else None

    def layer_launch(layer_buffers: Sequence[torch.Tensor], layer_base: int) -> Callable[[], None]:
        device_delta = component_deltas(layer_buffers, word_size)
        assert device_delta is not None, "group components with component_deltas first"
        device_words = as_words(layer_buffers[0], word)
        integers = (n, layer_base, *strides, host_delta, device_delta)
        arguments = (host_words, device_words, host_indices, device_indices, *integers)
        key = (
            constant_values, shape.warps, grid_size, components, device_index, host_words.dtype,
            _alignment_key(host_words, device_words, host_indices, device_indices),
            _int_widths(*integers),
        )  # fmt: skip

        def run() -> None:
            # a compiled kernel called directly costs a few us; the JIT's dispatch, tens
            runner = kernel.runners.get(key) if on_gpu else None
            if runner is not None:
                runner(*arguments, *constant_values)
                return
            compiled = launch(*arguments, **constants)
            if on_gpu and compiled is not None:
                kernel.runners[key] = compiled[(grid_size, components, 1)]

        return run

    return [
        layer_launch(
            layer_buffers, _words(layer_id * geometry.layer_stride, element_size, word_size)
        )
        for layer_buffers, layer_id in zip(device_buffers, layer_ids, strict=True)
    ]


def launch_row_copy(
    *,
    host_buffer: torch.Tensor,
    device_buffer: torch.Tensor,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    geometry: HostRowGeometry,
    layer_id: int,
    d2h: bool,
    grid: int | None = None,
    tile: TritonTile | None = None,
) -> None:
    """Launch one layer of one component now (``prepare_row_copy`` for a single layer)."""
    (run,) = prepare_row_copy(
        host_buffers=[host_buffer],
        device_buffers=[[device_buffer]],
        host_indices=host_indices,
        device_indices=device_indices,
        geometry=geometry,
        layer_ids=[layer_id],
        d2h=d2h,
        grid=grid,
        tile=tile,
    )
    run()
