"""Where a host token row lives, for each host buffer layout.

One host buffer per component, shaped by the layout (``L`` layers, ``size`` token slots, ``R`` the
component's row shape, ``page`` the page size):

| layout              | buffer shape              | row of (layer l, slot s)          |
|---------------------|---------------------------|-----------------------------------|
| ``layer_first``     | ``(L, size, *R)``         | ``buf[l, s]``                     |
| ``page_first``      | ``(size, L, *R)``         | ``buf[s, l]``                     |
| ``page_first_direct`` | ``(size//page, L, page, *R)`` | ``buf[s // page, l, s % page]`` |

Which io backend may drive which layout (upstream 0.5.10): ``direct`` copies slices and supports
``layer_first`` and ``page_first_direct``; ``kernel`` gathers per token and supports
``layer_first`` and ``page_first``.
"""

from __future__ import annotations

from typing import Literal

import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError

HostLayout = Literal["layer_first", "page_first", "page_first_direct"]
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first", "page_first_direct")

IoBackend = Literal["direct", "kernel"]
IO_BACKENDS: tuple[IoBackend, ...] = ("direct", "kernel")

LAYOUTS_BY_IO_BACKEND: dict[IoBackend, tuple[HostLayout, ...]] = {
    "direct": ("layer_first", "page_first_direct"),
    "kernel": ("layer_first", "page_first"),
}


def check_host_layout(layout: str) -> HostLayout:
    """Return ``layout`` typed, or raise ``UnknownOptionError`` naming the legal layouts."""
    if layout not in HOST_LAYOUTS:
        raise UnknownOptionError(
            f"unknown host layout {layout!r}; legal layouts: {', '.join(HOST_LAYOUTS)}"
        )
    return layout


def check_io_backend(io_backend: str, layout: HostLayout) -> IoBackend:
    """Return ``io_backend`` typed after checking it can drive ``layout``."""
    if io_backend not in IO_BACKENDS:
        raise UnknownOptionError(
            f"unknown io_backend {io_backend!r}; legal values: {', '.join(IO_BACKENDS)}"
        )
    backend: IoBackend = io_backend
    # Verify the (io_backend, layout) pair is one upstream implements
    if layout not in LAYOUTS_BY_IO_BACKEND[backend]:
        pairs = "; ".join(
            f"{name}: {', '.join(layouts)}" for name, layouts in LAYOUTS_BY_IO_BACKEND.items()
        )
        raise HiCacheInputError(
            f"io_backend {backend!r} cannot drive host layout {layout!r}; legal pairs: {pairs}"
        )
    return backend


def compute_host_buffer_shape(
    layout: HostLayout, size: int, layer_num: int, page_size: int, row_shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape of one component's host buffer (``size`` a multiple of ``page_size``)."""
    if layout == "layer_first":
        return (layer_num, size, *row_shape)
    if layout == "page_first":
        return (size, layer_num, *row_shape)
    return (size // page_size, layer_num, page_size, *row_shape)


def host_row_index(
    layout: HostLayout, layer_id: int, slots: torch.Tensor, page_size: int
) -> tuple[torch.Tensor | int, ...]:
    """An advanced-indexing key selecting rows ``slots`` of ``layer_id`` (shape ``(n, *R)``)."""
    if layout == "layer_first":
        return (layer_id, slots)
    if layout == "page_first":
        return (slots, layer_id)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    return (pages, layer_id, torch.remainder(slots, page_size))


def host_run_view(
    layout: HostLayout,
    buffer: torch.Tensor,
    layer_id: int,
    slot_start: int,
    length: int,
    page_size: int,
) -> torch.Tensor:
    """A view of rows ``slot_start .. slot_start + length - 1`` of ``layer_id`` (``(length, *R)``).

    For ``page_first_direct`` the run must stay inside one page (callers split runs at pages).
    """
    if layout == "layer_first":
        return buffer[layer_id, slot_start : slot_start + length]
    if layout == "page_first":
        return buffer[slot_start : slot_start + length, layer_id]
    page, offset = divmod(slot_start, page_size)
    # Verify the run stays inside one host page (callers split runs at pages, INV-01)
    if offset + length > page_size:
        raise InvariantViolation(
            "INV-01", f"a page_first_direct copy run {slot_start}+{length} crosses a host page"
        )
    return buffer[page, layer_id, offset : offset + length]


def host_page_rows(
    layout: HostLayout, buffer: torch.Tensor, slot_start: int, page_size: int
) -> torch.Tensor:
    """A view of one page of every layer, in the layout-independent order ``(L, page, *R)``."""
    if layout == "layer_first":
        return buffer[:, slot_start : slot_start + page_size]
    if layout == "page_first":
        return buffer[slot_start : slot_start + page_size].transpose(0, 1)
    return buffer[slot_start // page_size]
