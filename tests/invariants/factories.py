"""Builders of valid records for the invariants tests; a test changes one field to break one rule."""

from __future__ import annotations

import torch

PAGE = 16
"""The page size the tests use unless they say otherwise."""


def metadata_fields(
    *,
    pages: int = 2,
    page_size: int = PAGE,
    cp_size: int = 1,
    rank: int = 0,
    logical_len: int | None = None,
    host_base: int = 64 * PAGE,
    with_draft: bool = False,
) -> dict[str, object]:
    """Keyword arguments of a valid ``CpHiCacheNodeMetadata`` for one rank of a round-robin CP layout.

    The node spans ``pages`` logical pages; the last one is padded by 3 tokens unless
    ``logical_len`` says otherwise. Host slots start at ``host_base`` and are contiguous pages.
    """
    owners = [page % cp_size for page in range(pages)]
    owned = [
        page * page_size + offset
        for page in range(pages)
        if owners[page] == rank
        for offset in range(page_size)
    ]
    host = torch.arange(host_base, host_base + len(owned), dtype=torch.int64)
    return {
        "logical_len": pages * page_size - 3 if logical_len is None else logical_len,
        "padded_len": pages * page_size,
        "page_size": page_size,
        "owned_positions": torch.tensor(owned, dtype=torch.int64),
        "host_indices": host,
        "page_owners": torch.tensor(owners, dtype=torch.int8),
        "draft_host_indices": host + 8 * 64 * PAGE if with_draft else None,
    }


def pages_of(*starts: int, page_size: int = PAGE) -> torch.Tensor:
    """Whole pages beginning at each of ``starts``, as one int64 index tensor."""
    return torch.cat([torch.arange(s, s + page_size, dtype=torch.int64) for s in starts])


class FakeEvent:
    """An event that is never recorded: enough for records that only hold events."""

    def record(self, stream: object = None) -> None: ...

    def wait(self, stream: object = None) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...
