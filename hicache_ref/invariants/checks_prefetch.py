"""Checkers for storage prefetch accounting (INV-19 prefetch-ranges).

A prefetch fills a host bounce buffer page by page from storage. ``completed_tokens`` is what
the tree may publish, so it must only count pages whose bytes are set, and it must freeze when
``terminate_prefetch`` returns. The buffer then splits into ranges that are freed, inserted into
the tree or released, each slot exactly once (``hicache_ref/storage/operations.py`` names the
four ranges).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.errors import HiCacheInputError, InvariantViolation


def check_prefetch_progress(
    before_tokens: int,
    after_tokens: int,
    page_size: int,
    pages_with_bytes: int,
    *,
    terminated: bool,
) -> None:
    """Raise INV-19 unless one update of ``completed_tokens`` from ``before_tokens`` to
    ``after_tokens`` is legal.

    ``pages_with_bytes`` counts the pages whose bytes were written into the bounce buffer by
    then; ``terminated`` says whether ``terminate_prefetch`` had already returned. Counting a
    page before its bytes land lets a reader see garbage (sglang#8901); moving after termination
    makes the tree and the I/O thread free different ranges (bug class 13).
    """
    if page_size <= 0:
        raise HiCacheInputError(f"page_size must be positive, got {page_size}")
    # Verify progress is whole pages and never goes backwards
    if after_tokens % page_size != 0 or after_tokens < before_tokens:
        raise InvariantViolation(
            "INV-19",
            f"completed_tokens moved {before_tokens} -> {after_tokens} (it only grows, in whole "
            f"pages of page_size={page_size})",
        )
    # Verify progress freezes once terminate_prefetch has returned
    if terminated and after_tokens != before_tokens:
        raise InvariantViolation(
            "INV-19",
            f"completed_tokens moved {before_tokens} -> {after_tokens} after terminate_prefetch "
            "returned (increment must refuse once the operation is terminated)",
        )
    # Verify only pages whose bytes are set are counted
    if after_tokens > pages_with_bytes * page_size:
        raise InvariantViolation(
            "INV-19",
            f"completed_tokens={after_tokens} counts more than the {pages_with_bytes} pages whose "
            "bytes are set (set the page data before increasing completed_tokens)",
        )


def check_prefetch_release_split(
    num_tokens: int, released_ranges: Sequence[tuple[int, int]]
) -> None:
    """Raise INV-19 unless ``released_ranges`` cover ``[0, num_tokens)`` exactly once.

    The ranges are ``[0:matched)`` freed by the tree (duplicates of cached pages),
    ``[matched:min_completed)`` inserted into the tree, ``[min_completed:completed)`` released
    by the tree and ``[completed:n)`` released by the controller. A range given back twice is a
    double free (sglang#13483); a gap is a leak.
    """
    cursor = 0
    for start, end in sorted(released_ranges):
        # Verify each range is well formed and starts where the previous one ended
        if end < start:
            raise InvariantViolation("INV-19", f"released range [{start}, {end}) is reversed")
        if start < cursor:
            raise InvariantViolation(
                "INV-19",
                f"bounce-buffer tokens [{start}, {min(end, cursor)}) are released twice "
                "(each token of the buffer is released exactly once)",
            )
        if start > cursor:
            raise InvariantViolation(
                "INV-19",
                f"bounce-buffer tokens [{cursor}, {start}) are never released (leak)",
            )
        cursor = end
    # Verify the ranges reach the end of the buffer, and not beyond
    if cursor != num_tokens:
        raise InvariantViolation(
            "INV-19",
            f"released ranges end at {cursor} but the bounce buffer has {num_tokens} tokens "
            "(the three ranges must tile the buffer exactly)",
        )
