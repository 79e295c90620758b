"""Pure rules for page-shaped index tensors and CP node metadata (INV-01, INV-13).

Each ``find_*`` function returns ``None`` when the record obeys its rules, or a ``Problem``
naming the invariant and saying what is wrong and what would be right. The pydantic models in
``models.py`` turn a problem into a ``ValidationError``; the checkers in ``checks_layout.py``
turn it into an ``InvariantViolation``. Keeping the rules here means both agree on every word.

Value rules (sortedness, alignment, owners) read tensor *values*. Reading a value of a CUDA
tensor synchronizes its stream, which the controller's hot path must never do, so
``find_cp_metadata_problem(..., read_values=False)`` and every tensor that is not on the CPU
get shape, length and dtype checks only. ``is_host_readable`` says which tensors are safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch


@dataclass(frozen=True)
class Problem:
    """One broken rule: the invariant id and a message naming the culprit and the fix."""

    inv_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.inv_id}: {self.detail}"


def is_host_readable(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values is free of a device synchronization (CPU only)."""
    return tensor.is_cpu


@lru_cache(maxsize=32)
def _page_offsets(page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``arange(page_size)`` as one row, cached: it is read on every page check."""
    return torch.arange(page_size, dtype=dtype).unsqueeze(0)


def _is_index_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.int64, torch.int32)


def get_aligned_page_starts(indices: torch.Tensor, page_size: int) -> list[int] | None:
    """The first index of every page when ``indices`` are whole aligned pages, else None.

    One vectorized contiguity test plus a Python pass over the page starts: the cheapest
    form on small tensors, where each torch op costs microseconds. Reads values (CPU only).
    """
    assert page_size > 0 and indices.dim() == 1 and indices.numel() % page_size == 0
    if indices.numel() <= SMALL_INDEX_COUNT:
        return _aligned_page_starts_of_list(indices.tolist(), page_size)
    rows = indices.reshape(-1, page_size)
    if not torch.equal(rows, rows[:, :1] + _page_offsets(page_size, indices.dtype)):
        return None
    starts: list[int] = rows[:, 0].tolist()
    if all(start >= 0 and start % page_size == 0 for start in starts):
        return starts
    return None


SMALL_INDEX_COUNT = 512
"""Up to this many indices a Python pass over ``tolist()`` beats the vectorized test."""


def _aligned_page_starts_of_list(values: list[int], page_size: int) -> list[int] | None:
    """``get_aligned_page_starts`` over plain ints (the same answer, without torch ops)."""
    starts = values[::page_size]
    for page, start in enumerate(starts):
        if start < 0 or start % page_size != 0:
            return None
        base = page * page_size
        if values[base : base + page_size] != list(range(start, start + page_size)):
            return None
    return starts


def find_page_misalignment(indices: torch.Tensor, page_size: int, what: str) -> Problem | None:
    """The first page of ``indices`` that is not one aligned run ``p*page_size + arange(page_size)``.

    Direct page-first kernels read only the first index of each page and copy ``page_size``
    rows from there, so anything else is silently misplaced (bug class 18, sglang#35401).
    Reads values: call only with a CPU tensor (see ``is_host_readable``).
    """
    assert page_size > 0
    # Verify the tensor is a 1-D integer index list of whole pages
    if indices.dim() != 1 or not _is_index_dtype(indices.dtype):
        return Problem(
            "INV-01",
            f"{what} must be a 1-D int64 index tensor, got {indices.dim()}-D {indices.dtype}",
        )
    count = indices.numel()
    if count % page_size != 0:
        return Problem(
            "INV-01",
            f"{what} has {count} indices, not a multiple of page_size={page_size} "
            f"(a partial page can never be copied; pad to {-(-count // page_size) * page_size})",
        )
    # Verify each page is one contiguous run starting on a page boundary at a real slot
    if count == 0 or get_aligned_page_starts(indices, page_size) is not None:
        return None
    return _describe_first_bad_page(indices.reshape(-1, page_size).tolist(), page_size, what)


def _describe_first_bad_page(rows: list[list[int]], page_size: int, what: str) -> Problem:
    """Slow path of ``find_page_misalignment``: words for the first bad page."""
    for page, row in enumerate(rows):
        start = row[0]
        span = f"{what} page {page} (positions {page * page_size}..{(page + 1) * page_size - 1})"
        if start < 0:
            return Problem(
                "INV-01",
                f"{span} starts at {start}: a negative index is silently skipped by the "
                "transfer kernel (use a real slot)",
            )
        if start % page_size != 0:
            below = start - start % page_size
            return Problem(
                "INV-01",
                f"{span} starts at {start}, not a multiple of page_size={page_size} "
                f"(expected {below} or {below + page_size})",
            )
        for column, value in enumerate(row):
            if value != start + column:
                return Problem(
                    "INV-01",
                    f"{span} is not one contiguous run: position {page * page_size + column} "
                    f"holds {value}, expected {start + column}",
                )
    raise AssertionError("_describe_first_bad_page called on aligned pages")


def compute_padded_len(logical_len: int, page_size: int) -> int:
    """``logical_len`` rounded up to a whole number of pages."""
    assert logical_len >= 0 and page_size > 0
    return -(-logical_len // page_size) * page_size


def _find_length_problem(logical_len: int, padded_len: int, page_size: int) -> Problem | None:
    """INV-13 length rules: ``logical_len <= padded_len < logical_len + page_size``, whole pages."""
    if page_size <= 0:
        return Problem("INV-13", f"page_size={page_size} must be positive")
    if logical_len < 0:
        return Problem("INV-13", f"logical_len={logical_len} must be >= 0")
    expected = compute_padded_len(logical_len, page_size)
    if padded_len % page_size != 0:
        return Problem(
            "INV-13",
            f"padded_len={padded_len} is not a multiple of page_size={page_size} "
            f"(expected {expected} for logical_len={logical_len})",
        )
    if padded_len < logical_len:
        return Problem(
            "INV-13",
            f"padded_len={padded_len} is shorter than logical_len={logical_len} "
            f"(padding only adds a tail; expected {expected})",
        )
    if padded_len >= logical_len + page_size:
        return Problem(
            "INV-13",
            f"padded_len={padded_len} pads logical_len={logical_len} by a whole page or more "
            f"(page_size={page_size}; expected {expected})",
        )
    return None


def _find_shape_problem(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, length: int | None, length_rule: str
) -> Problem | None:
    """INV-13 shape rule for one metadata tensor: 1-D, ``dtype``, and ``length`` when given."""
    if tensor.dim() != 1 or tensor.dtype != dtype:
        return Problem(
            "INV-13",
            f"{name} must be a 1-D {dtype} tensor, got {tensor.dim()}-D {tensor.dtype}",
        )
    if length is not None and tensor.numel() != length:
        return Problem(
            "INV-13", f"len({name})={tensor.numel()} but {length_rule}={length} (they must match)"
        )
    return None


def find_cp_metadata_problem(
    *,
    logical_len: int,
    padded_len: int,
    page_size: int,
    owned_positions: torch.Tensor,
    host_indices: torch.Tensor,
    page_owners: torch.Tensor,
    draft_host_indices: torch.Tensor | None,
    read_values: bool = True,
) -> Problem | None:
    """The first broken rule of one CP node's HiCache metadata (INV-13, INV-01), or None.

    Shape rules always run. Value rules run only when ``read_values`` and the tensors involved
    are on the CPU, so a validator on the hot path never synchronizes a CUDA stream.
    """
    problem = _find_length_problem(logical_len, padded_len, page_size)
    if problem is not None:
        return problem
    num_pages = padded_len // page_size
    shape_rules: list[tuple[str, torch.Tensor, torch.dtype, int | None, str]] = [
        ("page_owners", page_owners, torch.int8, num_pages, "padded_len // page_size"),
        ("owned_positions", owned_positions, torch.int64, None, ""),
        (
            "host_indices",
            host_indices,
            torch.int64,
            owned_positions.numel(),
            "len(owned_positions)",
        ),
    ]
    if draft_host_indices is not None:
        shape_rules.append(
            ("draft_host_indices", draft_host_indices, torch.int64, host_indices.numel(),
             "len(host_indices)")
        )  # fmt: skip
    for name, tensor, dtype, length, length_rule in shape_rules:
        problem = _find_shape_problem(name, tensor, dtype, length, length_rule)
        if problem is not None:
            return problem
    if owned_positions.numel() > padded_len or owned_positions.numel() % page_size != 0:
        return Problem(
            "INV-13",
            f"len(owned_positions)={owned_positions.numel()} must be whole pages of "
            f"page_size={page_size} and at most padded_len={padded_len} (ranks own whole pages)",
        )
    if not read_values:
        return None
    return _find_value_problem(
        padded_len, page_size, owned_positions, host_indices, page_owners, draft_host_indices
    )


def _find_value_problem(
    padded_len: int,
    page_size: int,
    owned_positions: torch.Tensor,
    host_indices: torch.Tensor,
    page_owners: torch.Tensor,
    draft_host_indices: torch.Tensor | None,
) -> Problem | None:
    """Value rules of ``find_cp_metadata_problem``; each skipped for a tensor off the CPU."""
    owned_page_starts: list[int] | None = None
    if is_host_readable(owned_positions):
        owned_page_starts, problem = _check_owned_positions(owned_positions, padded_len, page_size)
        if problem is not None:
            return problem
    for name, tensor in (
        ("host_indices", host_indices),
        ("draft_host_indices", draft_host_indices),
    ):
        if tensor is not None and is_host_readable(tensor):
            problem = find_page_misalignment(tensor, page_size, f"metadata.{name}")
            if problem is not None:
                return problem
    if owned_page_starts is not None and is_host_readable(page_owners):
        owned_pages = [start // page_size for start in owned_page_starts]
        return _find_owner_problem(owned_pages, page_owners.tolist())
    return None


def _check_owned_positions(
    owned_positions: torch.Tensor, padded_len: int, page_size: int
) -> tuple[list[int], Problem | None]:
    """Page starts of ``owned_positions``, and the problem if they are not sorted, unique,
    inside ``[0, padded_len)`` and whole aligned pages (a rank owns whole logical pages)."""
    if owned_positions.numel() == 0:
        return [], None
    starts = get_aligned_page_starts(owned_positions, page_size)
    increasing = starts is not None and all(a < b for a, b in pairwise(starts))
    if starts is not None and increasing and starts[0] >= 0 and starts[-1] < padded_len:
        return starts, None
    return [], _describe_owned_positions_problem(owned_positions.tolist(), padded_len, page_size)


def _describe_owned_positions_problem(
    positions: list[int], padded_len: int, page_size: int
) -> Problem:
    """Slow path of ``_check_owned_positions``: the first rule that breaks, in words."""
    for at in range(1, len(positions)):
        left, right = positions[at - 1], positions[at]
        if right <= left:
            rule = "has a duplicate" if left == right else "is not sorted"
            return Problem(
                "INV-13",
                f"owned_positions {rule}: position {at} holds {right} after {left} "
                "(expected strictly increasing positions)",
            )
    for value in (positions[0], positions[-1]):
        if not 0 <= value < padded_len:
            return Problem(
                "INV-13", f"owned_positions holds {value}, outside [0, padded_len={padded_len})"
            )
    detail = _describe_first_bad_page(
        [positions[i : i + page_size] for i in range(0, len(positions), page_size)],
        page_size,
        "owned_positions",
    ).detail
    # Host page k mirrors owned_positions[k*page:(k+1)*page], so these must be whole pages.
    return Problem("INV-13", detail + " (a rank owns whole logical pages)")


def _find_owner_problem(owned_pages: list[int], page_owners: list[int]) -> Problem | None:
    """The owned pages are exactly the pages of one owner in ``page_owners``."""
    for page, owner in enumerate(page_owners):
        if owner < 0:
            return Problem("INV-13", f"page_owners[{page}]={owner} is not a CP rank (must be >= 0)")
    if not owned_pages:
        return None
    rank = page_owners[owned_pages[0]]
    expected_pages = [page for page, owner in enumerate(page_owners) if owner == rank]
    if owned_pages == expected_pages:
        return None
    return Problem(
        "INV-13",
        f"owned pages {owned_pages} are not the pages whose owner is rank {rank} "
        f"({expected_pages}) in page_owners (owner replay would misplace bytes)",
    )
