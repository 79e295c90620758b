"""Torch checks and padding of token-location tensors in whole pages (INV-01).

These are the torch faces of ``page_math.is_page_aligned_span`` and
``page_math.pad_locs_to_page_boundary``. Both stay free of host syncs on CUDA tensors: a CUDA
tensor is judged by its length only (known on the host), never by its values, because reading
values would stall the stream that produces them (the seed's ``_validate_cp_hicache_page_indices``
skips CUDA tensors for the same reason).
"""

from __future__ import annotations

import torch

from hicache_ref.errors import HiCacheInputError, PageAlignmentError

_SHOWN_VALUES_MAX = 8


def _format_values(values: torch.Tensor) -> str:
    """A short printable list of index values (at most ``_SHOWN_VALUES_MAX``)."""
    shown = [int(v) for v in values[:_SHOWN_VALUES_MAX]]
    suffix = ", ..." if values.numel() > _SHOWN_VALUES_MAX else ""
    return "[" + ", ".join(str(v) for v in shown) + suffix + "]"


def check_index_tensor(indices: torch.Tensor, name: str) -> None:
    """Raise ``HiCacheInputError`` unless ``indices`` is a 1-D integer tensor (no sync)."""
    # Verify a 1-D tensor of integer dtype (a float or bool mask is a caller bug)
    if not isinstance(indices, torch.Tensor):
        raise HiCacheInputError(
            f"{name} must be a torch.Tensor of token locations, got {type(indices).__name__}"
        )
    if indices.dim() != 1:
        raise HiCacheInputError(
            f"{name} must be 1-D token locations, got shape {tuple(indices.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise HiCacheInputError(f"{name} must have an integer dtype (int64), got {indices.dtype}")


SMALL_INDEX_MAX = 4096
"""Up to this many values a CPU index tensor is checked in Python over ``tolist()``: each torch
op on a tiny tensor costs microseconds, a Python pass over a few hundred ints less. Both forms
give the same answer (tests/pools/test_page_index.py compares them)."""


def get_small_cpu_values(indices: torch.Tensor) -> list[int] | None:
    """The values of a small CPU index tensor as ints, else ``None`` (use torch: large or CUDA).

    Reading a CUDA tensor's values would synchronize its stream, so CUDA tensors always take
    the torch path (which, for the checks here, reads lengths only)."""
    if not indices.is_cpu or indices.numel() > SMALL_INDEX_MAX:
        return None
    values: list[int] = indices.tolist()
    return values


def as_cpu_int64(indices: torch.Tensor) -> torch.Tensor:
    """``indices.to(device="cpu", dtype=torch.int64)``: the tensor itself when it is already
    that (as ``to`` returns it), without the call's cost on the hot path."""
    if indices.dtype == torch.int64 and indices.is_cpu:
        return indices
    return indices.to(device="cpu", dtype=torch.int64)


def validate_page_aligned_token_indices(indices: torch.Tensor, page_size: int, name: str) -> None:
    """Raise ``PageAlignmentError`` unless ``indices`` is whole aligned pages (INV-01).

    Each chunk of ``page_size`` locs must be ``p * page_size + arange(page_size)``. CUDA tensors are
    checked for length only (no host sync).
    """
    check_index_tensor(indices, name)
    if page_size < 1:
        raise HiCacheInputError(f"page_size must be >= 1, got {page_size}")
    # Verify whole pages by count (INV-01)
    if indices.numel() % page_size != 0:
        raise PageAlignmentError(
            f"INV-01: {name} has {indices.numel()} token locations, not a multiple of "
            f"page_size={page_size}; hand over whole pages only"
        )
    if indices.is_cuda or indices.numel() == 0:
        return
    values = get_small_cpu_values(indices)
    chunk = (
        find_misaligned_chunk_of_list(values, page_size)
        if values is not None
        else _find_misaligned_chunk(indices, page_size)
    )
    if chunk is None:
        return
    # Verify each page chunk is one aligned page (INV-01): report the first bad chunk
    held = indices[chunk * page_size : (chunk + 1) * page_size].to(torch.int64)
    page = int(held[0]) // page_size
    start = page * page_size
    raise PageAlignmentError(
        f"INV-01: {name} chunk {chunk} (positions {chunk * page_size}..{chunk * page_size + page_size - 1}) "
        f"holds {_format_values(held)}; a chunk must be one aligned page, e.g. page {page} = "
        f"[{start}..{start + page_size - 1}] (p * page_size + arange(page_size))"
    )


def _find_misaligned_chunk(indices: torch.Tensor, page_size: int) -> int | None:
    """The first chunk of ``page_size`` locs that is not one aligned page (torch form)."""
    pages = indices.to(torch.int64).view(-1, page_size)
    first = pages[:, 0]
    expected = first[:, None] + torch.arange(page_size, dtype=torch.int64)
    bad = (torch.remainder(first, page_size) != 0) | (pages != expected).any(dim=1)
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])


def find_misaligned_chunk_of_list(values: list[int], page_size: int) -> int | None:
    """``_find_misaligned_chunk`` over plain ints (the same answer, without torch ops)."""
    if page_size == 1:
        return None  # every loc is its own aligned page
    for chunk, base in enumerate(range(0, len(values), page_size)):
        first = values[base]
        if first % page_size != 0 or values[base : base + page_size] != list(
            range(first, first + page_size)
        ):
            return chunk
    return None


def pad_token_locs_to_page_boundary(locs: torch.Tensor, page_size: int, name: str) -> torch.Tensor:
    """Extend a partial last page of ``locs`` with consecutive locs up to the page end.

    ``locs`` must start every chunk on a page boundary and be contiguous inside each page (only the
    last chunk may be short); otherwise ``PageAlignmentError`` (INV-01). CUDA tensors are padded
    without a host sync and checked for nothing but their dtype and shape.
    """
    check_index_tensor(locs, name)
    if page_size < 1:
        raise HiCacheInputError(f"page_size must be >= 1, got {page_size}")
    n = locs.numel()
    missing = (page_size - n % page_size) % page_size
    values = get_small_cpu_values(locs) if n > 0 else None
    if values is not None:
        _validate_paddable_list(values, locs, page_size, name)
        if missing == 0:
            return locs
        padded = values + [values[-1] + k for k in range(1, missing + 1)]
        return torch.tensor(padded, dtype=locs.dtype)
    if not locs.is_cuda and n > 0:
        _validate_paddable(locs, page_size, name)
    if missing == 0:
        return locs
    tail = locs[-1:] + torch.arange(1, missing + 1, dtype=locs.dtype, device=locs.device)
    return torch.cat([locs, tail])


def _validate_paddable_list(
    values: list[int], locs: torch.Tensor, page_size: int, name: str
) -> None:
    """``_validate_paddable`` over the ints of a small CPU ``locs`` (its errors on a failure)."""
    full = len(values) - len(values) % page_size
    tail = values[full:]
    full_ok = find_misaligned_chunk_of_list(values[:full], page_size) is None
    tail_ok = not tail or (
        tail[0] % page_size == 0 and tail == list(range(tail[0], tail[0] + len(tail)))
    )
    if not (full_ok and tail_ok):
        _validate_paddable(locs, page_size, name)  # raises the torch form's message


def _validate_paddable(locs: torch.Tensor, page_size: int, name: str) -> None:
    """Check the full pages of ``locs`` and that the partial last chunk starts a page (INV-01)."""
    n = locs.numel()
    full = n - n % page_size
    if full > 0:
        validate_page_aligned_token_indices(locs[:full], page_size, name)
    if full == n:
        return
    tail = locs[full:].to(torch.int64)
    expected = tail[0] + torch.arange(tail.numel(), dtype=torch.int64)
    # Verify the partial last page starts on a page boundary and is contiguous (INV-01)
    if int(tail[0]) % page_size != 0 or not bool(torch.equal(tail, expected)):
        page = int(tail[0]) // page_size
        start = page * page_size
        raise PageAlignmentError(
            f"INV-01: {name} partial last page (positions {full}..{n - 1}) holds "
            f"{_format_values(tail)}; it must be the start of one aligned page, e.g. "
            f"[{start}..{start + tail.numel() - 1}] within page {page}"
        )
