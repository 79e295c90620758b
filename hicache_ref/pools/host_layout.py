"""Where a host token row lives, for each host buffer layout.

One host buffer per component, shaped by the layout (``L`` layers, ``size`` token slots, ``R`` the
component's row shape, ``P = size // page`` host pages, ``page`` the page size; for ``page_head``
``R = (H, D)``, heads and head dim):

| layout                | buffer shape              | row of (layer l, slot s)                  |
|-----------------------|---------------------------|-------------------------------------------|
| ``layer_first``       | ``(L, size, *R)``         | ``buf[l, s]``                             |
| ``page_first``        | ``(size, L, *R)``         | ``buf[s, l]``                             |
| ``page_first_direct`` | ``(P, L, page, *R)``      | ``buf[s // page, l, s % page]``           |
| ``page_head``         | ``(P, H, page, L, D)``    | ``buf[s // page, :, s % page, l]``        |
| ``layer_page_first``  | ``(L, P, page, *R)``      | ``buf[l, s // page, s % page]``           |

``page_head`` is upstream 0.5.10's MHA-only layout (its buffer is ``(2, P, H, page, L, D)``, K and
V stacked; here K and V are separate buffers): one page holds every layer of one head
contiguously, so a TP rank of another head split can take a head slice of a page. Upstream has no
``page_head`` for MLA pools, so MLA and NSA pools refuse it.

``layer_page_first`` is a fork-only layout (the CP/draft seed's ``move_indices`` names it, its
host pool is not public). The shape is inferred from the name: layer-major, then whole pages,
``(L, P, page, *R)``. The seed moves it like ``page_first_direct`` (device indices to the CPU,
host indices not sorted), i.e. page by page, so transfers under it take whole host pages with
contiguous device chunks, as ``page_first_direct`` does (INV-01).

Which io backend may drive which layout: ``direct`` copies slices and supports ``layer_first``,
``page_first_direct`` (upstream 0.5.10) and ``layer_page_first`` (the fork); ``kernel`` gathers
per token and supports ``layer_first``, ``page_first`` and ``page_head`` (upstream 0.5.10).
"""

from __future__ import annotations

from typing import Literal

import torch

from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError

HostLayout = Literal[
    "layer_first", "page_first", "page_first_direct", "page_head", "layer_page_first"
]
HOST_LAYOUTS: tuple[HostLayout, ...] = (
    "layer_first",
    "page_first",
    "page_first_direct",
    "page_head",
    "layer_page_first",
)

IoBackend = Literal["direct", "kernel"]
IO_BACKENDS: tuple[IoBackend, ...] = ("direct", "kernel")

LAYOUTS_BY_IO_BACKEND: dict[IoBackend, tuple[HostLayout, ...]] = {
    "direct": ("layer_first", "page_first_direct", "layer_page_first"),
    "kernel": ("layer_first", "page_first", "page_head"),
}

MHA_ONLY_LAYOUTS: tuple[HostLayout, ...] = ("page_head",)
"""Layouts that need rows of ``(heads, head_dim)`` (upstream defines them for MHA only)."""

LAYOUTS_BY_POOL_KIND: dict[str, tuple[HostLayout, ...]] = {
    "mha": HOST_LAYOUTS,
    "mla": tuple(layout for layout in HOST_LAYOUTS if layout not in MHA_ONLY_LAYOUTS),
    "nsa": tuple(layout for layout in HOST_LAYOUTS if layout not in MHA_ONLY_LAYOUTS),
}
"""The layouts a host pool of each device pool kind can take (any other pool: the MLA list)."""

PAGE_LOCAL_LAYOUTS: tuple[HostLayout, ...] = ("page_first_direct", "page_head", "layer_page_first")
"""Layouts whose rows of one layer are consecutive only inside one host page: a copy run is
split at host pages."""

WHOLE_PAGE_LAYOUTS: tuple[HostLayout, ...] = ("page_first_direct", "layer_page_first")
"""Layouts the ``direct`` backend moves page by page: each host chunk one aligned page, each
device chunk contiguous (upstream reads only the first index of a chunk, INV-01)."""


def check_host_layout(layout: str) -> HostLayout:
    """Return ``layout`` typed, or raise ``UnknownOptionError`` naming the legal layouts."""
    if layout not in HOST_LAYOUTS:
        raise UnknownOptionError(
            f"unknown host layout {layout!r}; legal layouts: {', '.join(HOST_LAYOUTS)}"
        )
    return layout


def check_layout_for_pool_kind(layout: HostLayout, pool_kind: str | None, pool_name: str) -> None:
    """Refuse a layout the device pool's kind cannot take (``page_head`` is MHA only)."""
    legal = LAYOUTS_BY_POOL_KIND.get(pool_kind or "", LAYOUTS_BY_POOL_KIND["mla"])
    # Verify the layout exists for this pool kind (upstream has page_head for MHA only)
    if layout not in legal:
        raise HiCacheInputError(
            f"host layout {layout!r} is MHA-only and cannot hold a {pool_name}; "
            f"legal layouts for it: {', '.join(legal)}"
        )


def is_whole_page_transfer(io_backend: IoBackend, layout: HostLayout) -> bool:
    """Whether a transfer of ``io_backend`` under ``layout`` moves whole pages (INV-01 checks)."""
    return io_backend == "direct" and layout in WHOLE_PAGE_LAYOUTS


def describe_legal_pairs() -> str:
    """``direct: a, b; kernel: c, d``: every (io_backend, layout) pair that may run."""
    return "; ".join(
        f"{name}: {', '.join(layouts)}" for name, layouts in LAYOUTS_BY_IO_BACKEND.items()
    )


def check_io_backend(io_backend: str, layout: HostLayout) -> IoBackend:
    """Return ``io_backend`` typed after checking it can drive ``layout``."""
    if io_backend not in IO_BACKENDS:
        raise UnknownOptionError(
            f"unknown io_backend {io_backend!r}; legal values: {', '.join(IO_BACKENDS)}"
        )
    backend: IoBackend = io_backend
    # Verify the (io_backend, layout) pair is one upstream (or the fork) implements
    if layout not in LAYOUTS_BY_IO_BACKEND[backend]:
        raise HiCacheInputError(
            f"io_backend {backend!r} cannot drive host layout {layout!r}; "
            f"legal pairs: {describe_legal_pairs()}"
        )
    return backend


def compute_host_buffer_shape(
    layout: HostLayout, size: int, layer_num: int, page_size: int, row_shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape of one component's host buffer (``size`` a multiple of ``page_size``)."""
    num_pages = size // page_size
    if layout == "layer_first":
        return (layer_num, size, *row_shape)
    if layout == "page_first":
        return (size, layer_num, *row_shape)
    if layout == "page_first_direct":
        return (num_pages, layer_num, page_size, *row_shape)
    if layout == "layer_page_first":
        return (layer_num, num_pages, page_size, *row_shape)
    # Verify page_head rows are (heads, head_dim)
    if len(row_shape) != 2:
        raise HiCacheInputError(
            f"host layout 'page_head' needs rows of (heads, head_dim), got {row_shape}"
        )
    head_num, head_dim = row_shape
    return (num_pages, head_num, page_size, layer_num, head_dim)


def host_row_index(
    layout: HostLayout, layer_id: int, slots: torch.Tensor, page_size: int
) -> tuple[torch.Tensor | int | slice, ...]:
    """An advanced-indexing key selecting rows ``slots`` of ``layer_id`` (shape ``(n, *R)``).

    For ``page_head`` the advanced indices (page, offset, layer) are split by the head slice, so
    torch puts their dimension first: ``(n, H, D)``, the row order of every other layout.
    """
    if layout == "layer_first":
        return (layer_id, slots)
    if layout == "page_first":
        return (slots, layer_id)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = torch.remainder(slots, page_size)
    if layout == "page_first_direct":
        return (pages, layer_id, offsets)
    if layout == "layer_page_first":
        return (layer_id, pages, offsets)
    return (pages, slice(None), offsets, layer_id)


def host_run_view(
    layout: HostLayout,
    buffer: torch.Tensor,
    layer_id: int,
    slot_start: int,
    length: int,
    page_size: int,
) -> torch.Tensor:
    """A view of rows ``slot_start .. slot_start + length - 1`` of ``layer_id`` (``(length, *R)``).

    For the ``PAGE_LOCAL_LAYOUTS`` the run must stay inside one page (callers split runs at pages).
    """
    if layout == "layer_first":
        return buffer[layer_id, slot_start : slot_start + length]
    if layout == "page_first":
        return buffer[slot_start : slot_start + length, layer_id]
    page, offset = divmod(slot_start, page_size)
    # Verify the run stays inside one host page (callers split runs at pages, INV-01)
    if offset + length > page_size:
        raise InvariantViolation(
            "INV-01", f"a {layout} copy run {slot_start}+{length} crosses a host page"
        )
    if layout == "page_first_direct":
        return buffer[page, layer_id, offset : offset + length]
    if layout == "layer_page_first":
        return buffer[layer_id, page, offset : offset + length]
    # page_head: (H, length, D) -> (length, H, D), a strided view
    return buffer[page, :, offset : offset + length, layer_id].transpose(0, 1)


def host_page_rows(
    layout: HostLayout, buffer: torch.Tensor, slot_start: int, page_size: int
) -> torch.Tensor:
    """A view of one page of every layer, in the layout-independent order ``(L, page, *R)``."""
    page = slot_start // page_size
    if layout == "layer_first":
        return buffer[:, slot_start : slot_start + page_size]
    if layout == "page_first":
        return buffer[slot_start : slot_start + page_size].transpose(0, 1)
    if layout == "page_first_direct":
        return buffer[page]
    if layout == "layer_page_first":
        return buffer[:, page]
    # page_head: (H, page, L, D) -> (L, page, H, D)
    return buffer[page].permute(2, 1, 0, 3)
