"""Optimized page helpers that must behave exactly like ``pools/page_math`` (diffbehavior).

A fast path is only worth having if it is provably the same function; CrossHair's
``diffbehavior`` searches for an input where the two differ (``.ci/crosshair.sh``). The leading
asserts repeat the reference's, so invalid input fails the same way in both.
"""

from __future__ import annotations


def compute_page_owner_fast(page: int, cp_size: int) -> int:
    """The owner rank of a logical page: a bit mask when ``cp_size`` is a power of two.

    pre: page >= 0
    pre: cp_size >= 1
    post: 0 <= __return__ < cp_size
    """
    assert page >= 0
    assert cp_size >= 1
    if cp_size & (cp_size - 1) == 0:
        return page & (cp_size - 1)
    return page % cp_size


def compute_padded_len_fast(n: int, page_size: int) -> int:
    """``n`` rounded up to a page multiple: masking for power-of-two page sizes.

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    """
    assert n >= 0
    assert page_size >= 1
    if page_size & (page_size - 1) == 0:
        return (n + page_size - 1) & -page_size
    return -(-n // page_size) * page_size
