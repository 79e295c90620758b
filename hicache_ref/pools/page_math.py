"""Pure integer arithmetic of pages, CP ownership and copy runs (no torch).

Everything here works on ``int`` and ``list[int]`` with plain loops so CrossHair can check it
unchanged. Preconditions are the leading ``assert`` statements (CrossHair's ``asserts`` kind) and
are repeated as ``pre:`` lines; postconditions are ``post:`` lines (CrossHair's ``PEP316`` kind).
The torch wrappers in ``page_index.py`` and ``cp_layout.py`` must agree with these functions;
the tests compare them.

Vocabulary (SGLang's): a *loc* is a token location in a device pool, a *page* is
``loc // page_size``, and a span is *page aligned* when it splits into chunks of ``page_size``
locs, each chunk being ``p * page_size + arange(page_size)`` (INV-01). Under context parallelism
(CP) a logical page ``p`` is owned by rank ``p % cp_size`` and lives on that rank at physical page
``p // cp_size``.
"""

from __future__ import annotations


def compute_padded_len(n: int, page_size: int) -> int:
    """Round a token count up to a whole number of pages (a CP node's ``padded_len``, INV-13).

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: n <= __return__ < n + page_size
    """
    assert n >= 0
    assert page_size >= 1
    return (n + page_size - 1) // page_size * page_size


def compute_num_pages(n: int, page_size: int) -> int:
    """Number of pages that ``n`` tokens touch (a partial last page counts).

    pre: n >= 0
    pre: page_size >= 1
    post: __return__ * page_size >= n
    post: __return__ == 0 or (__return__ - 1) * page_size < n
    """
    assert n >= 0
    assert page_size >= 1
    return (n + page_size - 1) // page_size


def compute_physical_num_pages(logical_num_pages: int, cp_size: int) -> int:
    """Pages one CP rank needs to hold its share of ``logical_num_pages`` logical pages.

    Logical pages ``0 .. logical_num_pages - 1`` map to physical pages ``p // cp_size``, so the
    highest physical page is ``(logical_num_pages - 1) // cp_size``.

    pre: logical_num_pages >= 0
    pre: cp_size >= 1
    post: __return__ * cp_size >= logical_num_pages
    post: logical_num_pages == 0 or __return__ == (logical_num_pages - 1) // cp_size + 1
    """
    assert logical_num_pages >= 0
    assert cp_size >= 1
    return (logical_num_pages + cp_size - 1) // cp_size


def is_page_aligned_span(locs: list[int], page_size: int) -> bool:
    """Whether ``locs`` is whole aligned pages: each chunk is ``p * page_size + arange(page_size)``.

    Only alignment is judged here; whether the pages exist (range, sign) is the caller's check.

    pre: page_size >= 1
    post: (not __return__) or len(locs) % page_size == 0
    post: (not __return__) or all(locs[i] % page_size == 0 for i in range(0, len(locs), page_size))
    """
    assert page_size >= 1
    if len(locs) % page_size != 0:
        return False
    for start in range(0, len(locs), page_size):
        first = locs[start]
        if first % page_size != 0:
            return False
        for offset in range(1, page_size):
            if locs[start + offset] != first + offset:
                return False
    return True


def is_paddable_span(locs: list[int], page_size: int) -> bool:
    """Whether ``locs`` can be padded to whole pages: every chunk starts on a page boundary and
    is contiguous; only the last chunk may be shorter than a page.

    pre: page_size >= 1
    post: (not __return__) or is_page_aligned_span(locs[: len(locs) - len(locs) % page_size], page_size)
    """
    assert page_size >= 1
    for start in range(0, len(locs), page_size):
        first = locs[start]
        if first % page_size != 0:
            return False
        end = min(start + page_size, len(locs))
        for i in range(start + 1, end):
            if locs[i] != first + (i - start):
                return False
    return True


def pad_locs_to_page_boundary(locs: list[int], page_size: int) -> list[int]:
    """Extend a partial last page with the consecutive locs up to that page's end.

    pre: page_size >= 1
    pre: is_paddable_span(locs, page_size)
    post: len(__return__) == compute_padded_len(len(locs), page_size)
    post: __return__[: len(locs)] == locs
    post: is_page_aligned_span(__return__, page_size)
    """
    assert page_size >= 1
    assert is_paddable_span(locs, page_size)
    padded = list(locs)
    missing = compute_padded_len(len(locs), page_size) - len(locs)
    for step in range(1, missing + 1):
        padded.append(locs[-1] + step)
    return padded


def compute_page_owner(page: int, cp_size: int) -> int:
    """The CP rank owning logical ``page`` (round robin).

    pre: page >= 0
    pre: cp_size >= 1
    post: 0 <= __return__ < cp_size
    post: (page - __return__) % cp_size == 0
    """
    assert page >= 0
    assert cp_size >= 1
    return page % cp_size


def compute_physical_loc(loc: int, page_size: int, cp_size: int) -> int:
    """Where logical ``loc`` lives on its owner rank: physical page ``page // cp_size``.

    pre: loc >= 0
    pre: page_size >= 1
    pre: cp_size >= 1
    post: __return__ % page_size == loc % page_size
    post: __return__ // page_size == (loc // page_size) // cp_size
    post: 0 <= __return__ <= loc
    """
    assert loc >= 0
    assert page_size >= 1
    assert cp_size >= 1
    return (loc // page_size // cp_size) * page_size + loc % page_size


def compute_owned_positions(
    locs: list[int], page_size: int, cp_size: int, cp_rank: int
) -> list[int]:
    """Positions ``i`` (into ``locs``) whose page ``cp_rank`` owns, ascending.

    These are a CP node's ``owned_positions``: sorted, unique and inside the span (INV-13).

    pre: page_size >= 1
    pre: cp_size >= 1
    pre: 0 <= cp_rank < cp_size
    pre: all(loc >= 0 for loc in locs)
    post: all(0 <= i < len(locs) for i in __return__)
    post: all(__return__[k] < __return__[k + 1] for k in range(len(__return__) - 1))
    post: all(compute_page_owner(locs[i] // page_size, cp_size) == cp_rank for i in __return__)
    """
    assert page_size >= 1
    assert cp_size >= 1
    assert 0 <= cp_rank < cp_size
    assert all(loc >= 0 for loc in locs)
    owned: list[int] = []
    for i, loc in enumerate(locs):
        if compute_page_owner(loc // page_size, cp_size) == cp_rank:
            owned.append(i)
    return owned


def compute_page_owners(locs: list[int], page_size: int, cp_size: int) -> list[int]:
    """One owner per page chunk of ``locs``, judged by the chunk's first loc (a CP node's
    ``page_owners``: one entry per page, INV-13; ``load_cp`` replays them, INV-03).

    pre: page_size >= 1
    pre: cp_size >= 1
    pre: all(loc >= 0 for loc in locs)
    post: len(__return__) == compute_num_pages(len(locs), page_size)
    post: all(0 <= owner < cp_size for owner in __return__)
    """
    assert page_size >= 1
    assert cp_size >= 1
    assert all(loc >= 0 for loc in locs)
    owners: list[int] = []
    for start in range(0, len(locs), page_size):
        owners.append(compute_page_owner(locs[start] // page_size, cp_size))
    return owners


def plan_copy_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge index pairs into maximal runs ``(src_start, dst_start, length)`` where both advance
    by +1, the way ``transfer_kv_direct`` merges them before issuing slice copies.

    pre: len(src) == len(dst)
    post: expand_copy_runs(__return__) == (src, dst)
    post: all(length >= 1 for _, _, length in __return__)
    post: all(not is_run_continued(__return__[k], __return__[k + 1]) for k in range(len(__return__) - 1))
    """
    assert len(src) == len(dst)
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(src):
        length = 1
        while (
            i + length < len(src)
            and src[i + length] == src[i] + length
            and dst[i + length] == dst[i] + length
        ):
            length += 1
        runs.append((src[i], dst[i], length))
        i += length
    return runs


def is_run_continued(run: tuple[int, int, int], following: tuple[int, int, int]) -> bool:
    """Whether ``following`` starts exactly where ``run`` ends on both sides (so they merge).

    post: __return__ == (following[0] == run[0] + run[2] and following[1] == run[1] + run[2])
    """
    src_start, dst_start, length = run
    return following[0] == src_start + length and following[1] == dst_start + length


def expand_copy_runs(runs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """The index pairs a list of runs covers, in order (inverse of ``plan_copy_runs``).

    pre: all(length >= 0 for _, _, length in runs)
    post: len(__return__[0]) == len(__return__[1]) == sum(length for _, _, length in runs)
    """
    assert all(length >= 0 for _, _, length in runs)
    src: list[int] = []
    dst: list[int] = []
    for src_start, dst_start, length in runs:
        for offset in range(length):
            src.append(src_start + offset)
            dst.append(dst_start + offset)
    return src, dst


def split_runs_at_pages(
    runs: list[tuple[int, int, int]], page_size: int, *, split_src: bool
) -> list[tuple[int, int, int]]:
    """Cut runs so that no run crosses a page boundary on one side (src or dst).

    ``page_first_direct`` host buffers are contiguous only inside one page, so a run copied as one
    slice there must stay inside one page.

    pre: page_size >= 1
    pre: all(length >= 1 for _, _, length in runs)
    post: expand_copy_runs(__return__) == expand_copy_runs(runs)
    """
    assert page_size >= 1
    assert all(length >= 1 for _, _, length in runs)
    pieces: list[tuple[int, int, int]] = []
    for src_start, dst_start, length in runs:
        done = 0
        while done < length:
            side_start = (src_start if split_src else dst_start) + done
            room = page_size - side_start % page_size
            piece = min(room, length - done)
            pieces.append((src_start + done, dst_start + done, piece))
            done += piece
    return pieces
