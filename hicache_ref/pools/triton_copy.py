"""A Triton gather/scatter kernel between a (pinned) host pool and a device pool, zero-copy.

The kernel reads or writes the host buffer directly through unified addressing (a pinned
buffer's host address is valid on the GPU), so no staging buffer and no copy engine is used; it
costs SMs instead. A persistent grid of ``grid`` programs walks the index pairs
(``i = pid, pid + grid, ...``); each pair moves one token row of one layer as ``piece_num``
contiguous vectors of 4-byte words (one piece per row, or one per head under ``page_head``),
addressed by ``HostRowGeometry``. Index tensors are read on the device when the kernel runs.

On the CPU (``SimDevice``) the same kernel runs under Triton's interpreter when Triton is
installed, so the differential tests can compare it with the gather path; ``is_triton_available``
says whether it can run at all. Triton is optional: nothing here imports it at module import.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools.copy_plan import HostRowGeometry

TRITON_GRID_DEFAULT = 132
"""Programs of the persistent grid (one per SM of an H100/H200: the measured ceiling)."""

_grid = [TRITON_GRID_DEFAULT]


@contextmanager
def triton_grid(programs: int) -> Iterator[None]:
    """Within the block, ``copy_path='triton'`` launches ``programs`` programs per kernel."""
    # Verify a positive grid
    if programs < 1:
        raise HiCacheInputError(f"triton grid must be >= 1 programs, got {programs}")
    previous = _grid[0]
    _grid[0] = programs
    try:
        yield
    finally:
        _grid[0] = previous


def current_triton_grid() -> int:
    """The grid ``copy_path='triton'`` launches now (``TRITON_GRID_DEFAULT`` outside blocks)."""
    return _grid[0]


def is_triton_available() -> bool:
    """Whether ``import triton`` can work in this environment."""
    return importlib.util.find_spec("triton") is not None


def compute_word_dtype(geometry: HostRowGeometry, element_size: int) -> torch.dtype:
    """The widest word (4, 2 or 1 bytes) that divides every piece and stride of ``geometry``."""
    spans = (
        geometry.piece_numel,
        geometry.layer_stride,
        geometry.page_stride,
        geometry.slot_stride,
        geometry.piece_stride,
    )
    for word, dtype in ((4, torch.int32), (2, torch.int16)):
        if all(span * element_size % word == 0 for span in spans):
            return dtype
    return torch.uint8


def as_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous buffer reinterpreted as a flat vector of ``dtype`` words (a view)."""
    return tensor.reshape(-1).view(torch.uint8).view(dtype)


def _words(count_elements: int, element_size: int, word_size: int) -> int:
    return count_elements * element_size // word_size


tl: Any = None
"""``triton.language``, bound by ``_kernel`` on first use (Triton is optional)."""


def _paged_row_copy(  # type: ignore[no-untyped-def]
    host_ptr,
    device_ptr,
    host_idx_ptr,
    device_idx_ptr,
    n,
    host_layer_base,
    page_size,
    page_stride,
    slot_stride,
    piece_stride,
    device_row_stride,
    PIECE_NUM: tl.constexpr,
    PIECE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    D2H: tl.constexpr,
):
    """Triton source: pairs ``pid, pid + grid, ...``; one row (``PIECE_NUM`` pieces) each."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < PIECE_WORDS
    for i in range(pid, n, programs):
        slot = tl.load(host_idx_ptr + i).to(tl.int64)
        loc = tl.load(device_idx_ptr + i).to(tl.int64)
        page = slot // page_size
        host_row = host_layer_base + page * page_stride + (slot - page * page_size) * slot_stride
        device_row = loc * device_row_stride
        for piece in tl.static_range(PIECE_NUM):
            host_at = host_ptr + host_row + piece * piece_stride + cols
            device_at = device_ptr + device_row + piece * PIECE_WORDS + cols
            if D2H:
                tl.store(host_at, tl.load(device_at, mask=mask), mask=mask)
            else:
                tl.store(device_at, tl.load(host_at, mask=mask), mask=mask)


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel (compiled for the GPU, or wrapped by Triton's interpreter)."""
    global tl
    tl = importlib.import_module("triton.language")
    if interpret:
        interpreter = importlib.import_module("triton.runtime.interpreter")
        return interpreter.InterpretedFunction(_paged_row_copy)
    return importlib.import_module("triton").jit(_paged_row_copy)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
) -> None:
    """Launch one layer of one component (on the current stream; the indices must be on the
    device that runs the kernel: CUDA for a CUDA pool, CPU for the interpreter)."""
    programs = current_triton_grid() if grid is None else grid
    # Verify a positive grid and a pair per index
    if programs < 1:
        raise HiCacheInputError(f"triton grid must be >= 1 programs, got {programs}")
    assert host_indices.numel() == device_indices.numel()
    n = host_indices.numel()
    if n == 0:
        return
    element_size = host_buffer.element_size()
    word = compute_word_dtype(geometry, element_size)
    word_size = torch.empty((), dtype=word).element_size()
    piece_words = _words(geometry.piece_numel, element_size, word_size)
    kernel = _kernel(not device_buffer.is_cuda)
    launch: Callable[..., None] = kernel[(min(programs, n),)]
    launch(
        as_words(host_buffer, word),
        as_words(device_buffer, word),
        host_indices,
        device_indices,
        n,
        _words(layer_id * geometry.layer_stride, element_size, word_size),
        geometry.page_size,
        _words(geometry.page_stride, element_size, word_size),
        _words(geometry.slot_stride, element_size, word_size),
        _words(geometry.piece_stride, element_size, word_size),
        piece_words * geometry.piece_num,
        PIECE_NUM=geometry.piece_num,
        PIECE_WORDS=piece_words,
        BLOCK=_next_power_of_two(piece_words),
        D2H=d2h,
    )
