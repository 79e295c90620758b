"""The Triton source of the zero-copy row copy (``triton_copy`` explains it and launches it).

Triton compiles a kernel from its source and resolves ``tl`` in the module that defines it, so
the source lives here, with ``triton.language`` imported at the top: importing this module
imports Triton, and only ``triton_copy._kernel`` does, the first time a kernel is built.
"""

from __future__ import annotations

import importlib
from typing import Any

tl: Any = importlib.import_module("triton.language")
"""``triton.language`` (Triton ships no type information, so it is imported as a value)."""


def paged_row_copy(  # type: ignore[no-untyped-def]
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
    host_component_delta,
    device_component_delta,
    PIECE_NUM: tl.constexpr,
    PIECE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    VEC: tl.constexpr,
    D2H: tl.constexpr,
):
    """Triton source: tiles of ``ROWS`` pairs at ``pid, pid + grid, ...``; one row each;
    axis 1 is the component, ``delta`` words past component 0 on each side."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    component = tl.program_id(1).to(tl.int64)
    host_base = host_layer_base + component * host_component_delta
    device_base = component * device_component_delta
    cols = tl.arange(0, BLOCK)
    col_mask = cols < PIECE_WORDS
    rows = tl.arange(0, ROWS)
    for start in range(pid * ROWS, n, programs * ROWS):
        pair = start + rows
        row_mask = pair < n
        slot = tl.load(host_idx_ptr + pair, mask=row_mask, other=0).to(tl.int64)
        loc = tl.load(device_idx_ptr + pair, mask=row_mask, other=0).to(tl.int64)
        page = slot // page_size
        host_row = host_base + page * page_stride + (slot - page * page_size) * slot_stride
        host_row = tl.multiple_of(host_row, VEC)
        device_row = tl.multiple_of(device_base + loc * device_row_stride, VEC)
        mask = row_mask[:, None] & col_mask[None, :]
        for piece in tl.static_range(PIECE_NUM):
            host_at = host_ptr + (host_row + piece * piece_stride)[:, None] + cols[None, :]
            device_at = device_ptr + (device_row + piece * PIECE_WORDS)[:, None] + cols[None, :]
            if D2H:
                tl.store(host_at, tl.load(device_at, mask=mask), mask=mask)
            else:
                tl.store(device_at, tl.load(host_at, mask=mask), mask=mask)
