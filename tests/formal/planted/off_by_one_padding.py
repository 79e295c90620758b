"""``pools.page_math.compute_padded_len`` with an off-by-one: an aligned length gains a page."""

from __future__ import annotations


def compute_padded_len_planted(n: int, page_size: int) -> int:
    """Round a token count up to a whole number of pages (planted bug: ``+ page_size``).

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: n <= __return__ < n + page_size
    """
    assert n >= 0
    assert page_size >= 1
    return (n + page_size) // page_size * page_size
