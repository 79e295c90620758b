"""``oracle.storage.keys.compute_leading_run`` with the wrong ``continue``: it counts the pages
present after the first missing one (the window "progress never past a hole", INV-19)."""

from __future__ import annotations


def compute_leading_run_planted(present: tuple[bool, ...], start: int, end: int) -> int:
    """Pages present from ``start`` on, up to ``end`` (planted bug: skips a missing page).

    pre: len(present) <= 6
    pre: 0 <= start <= end <= len(present)
    post: 0 <= __return__ <= end - start
    post: all(present[start : start + __return__])
    """
    run = 0
    for page in range(start, end):
        if not present[page]:
            continue
        run += 1
    return run
