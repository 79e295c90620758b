"""Pure helpers of the storage protocol, each with CrossHair contracts (``pre:``/``post:``).

In flow order: the page keys of a chain (INV-27), the batches a call walks, the leading run a
query or a read finds (INV-19, INV-29), the MIN over ranks (INV-21, INV-29), and how a bounce
buffer splits into the ranges the tree frees, inserts and releases (INV-19, INV-23). The step
functions call these; ``.ci/crosshair.sh`` checks every contract over all paths.
"""

from __future__ import annotations

Key = tuple[int, ...]
"""A page key: the whole token prefix it commits to (any injective digest of it would do)."""


def compute_chain_keys(tokens: tuple[int, ...], page_size: int, prior: Key) -> tuple[Key, ...]:
    """The key of every whole page of ``tokens``, chained after ``prior`` (INV-27).

    Page ``i``'s key is ``prior`` plus ``tokens[0 : (i + 1) * page_size]``: it commits to the
    whole prefix, so two prefixes never share a key and a partial trailing page has none.

    pre: 1 <= page_size <= 3
    pre: len(tokens) <= 6
    post: len(__return__) == len(tokens) // page_size
    post: all(k == prior + tokens[: (i + 1) * page_size] for i, k in enumerate(__return__))
    post: len(set(__return__)) == len(__return__)
    """
    whole = len(tokens) - len(tokens) % page_size
    return tuple(prior + tokens[:end] for end in range(page_size, whole + 1, page_size))


def count_batches(pages: int, batch_pages: int) -> int:
    """How many backend calls a loop over ``pages`` pages makes, ``batch_pages`` at a time.

    pre: 0 <= pages <= 64
    pre: 1 <= batch_pages <= 8
    post: __return__ * batch_pages >= pages
    post: (__return__ - 1) * batch_pages < pages or __return__ == 0
    """
    return -(-pages // batch_pages)


def compute_batch_range(batch: int, batch_pages: int, pages: int) -> tuple[int, int]:
    """Pages ``[start, end)`` of batch ``batch`` of a loop over ``pages`` pages.

    pre: 1 <= batch_pages <= 4
    pre: 0 <= pages <= 16
    pre: 0 <= batch and batch * batch_pages < pages
    post: 0 <= __return__[0] < __return__[1] <= pages
    post: __return__[1] - __return__[0] <= batch_pages
    post: __return__[0] == batch * batch_pages
    """
    start = batch * batch_pages
    return start, min(start + batch_pages, pages)


def compute_leading_run(present: tuple[bool, ...], start: int, end: int) -> int:
    """How many pages from ``start`` on are present before the first missing one, up to ``end``
    (a hit run stops at its first miss; a read counts only the leading pages it got).

    pre: len(present) <= 6
    pre: 0 <= start <= end <= len(present)
    post: 0 <= __return__ <= end - start
    post: all(present[start : start + __return__])
    post: __return__ == end - start or not present[start + __return__]
    """
    run = 0
    while start + run < end and present[start + run]:
        run += 1
    return run


def reduce_min(values: tuple[int, ...]) -> int:
    """The MIN over ranks of their contributions (``all_reduce(op=MIN)``).

    pre: 1 <= len(values) <= 4
    post: __return__ in values
    post: all(__return__ <= v for v in values)
    """
    return min(values)


def compute_hit_endpoint(runs: tuple[int, ...], pages: int) -> int:
    """The hit every rank publishes: the MIN of the ranks' leading runs, within the query
    (INV-29: an endpoint every rank can serve, never shortened below it). The contract is
    checked for up to three ranks, where CrossHair exhausts every path at the CI budget.

    pre: 1 <= len(runs) <= 3
    pre: 0 <= pages <= 8
    pre: all(0 <= r <= pages for r in runs)
    post: 0 <= __return__ <= pages
    post: all(__return__ <= r for r in runs)
    post: __return__ in runs
    """
    return min(runs)


def compute_release_split(hit: int, matched: int, completed: int) -> tuple[tuple[int, int], ...]:
    """How a bounce buffer of ``hit`` pages splits once its prefetch settled (INV-19):
    ``[0, matched)`` freed by the tree (cached meanwhile), ``[matched, completed)`` inserted,
    ``[completed, hit)`` released after the final ack (owned by the IO until then, INV-23).

    pre: 0 <= matched <= completed <= hit <= 64
    post: len(__return__) == 3
    post: __return__[0][0] == 0 and __return__[-1][1] == hit
    post: all(__return__[i][1] == __return__[i + 1][0] for i in range(2))
    post: sum(e - s for s, e in __return__) == hit
    """
    return ((0, matched), (matched, completed), (completed, hit))


def compute_io_owned(hit: int, published: int, final_drained: bool) -> tuple[int, int]:
    """The pages of a bounce buffer its IO still owns: past the published progress, until the
    tree drained the final ack (INV-23).

    pre: 0 <= published <= hit <= 64
    post: __return__[0] == published
    post: __return__[1] == (published if final_drained else hit)
    post: __return__[0] <= __return__[1]
    """
    return (published, published if final_drained else hit)
