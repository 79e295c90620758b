"""A "fast" page owner that masks even when ``cp_size`` is not a power of two (diffbehavior)."""

from __future__ import annotations


def compute_page_owner_mask(page: int, cp_size: int) -> int:
    """The owner rank of a logical page by masking (planted bug: wrong for cp_size=3)."""
    assert page >= 0
    assert cp_size >= 1
    return page & (cp_size - 1)
