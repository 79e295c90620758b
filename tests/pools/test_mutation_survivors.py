"""Checks that close pool mutants the stateful suite let survive (benchmarks/mutation.py).

Each test names the mutant class it kills: inputs the transfer planner never produces but the
pure helpers' contracts allow (a zero-length run), and the slot or position ranges that a refused
host free and a misaligned chunk name, and the keyword arguments of ``make_host_pool``'s
fallback for a device pool of no exact known kind.
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import DoubleFreeError, PageAlignmentError
from hicache_ref.pools import HostKVCache, MHATokenToKVPool, make_host_pool
from hicache_ref.pools.page_index import validate_page_aligned_token_indices
from hicache_ref.pools.page_math import expand_copy_runs

from .builders import make_device_pool


# -- page_math.expand_copy_runs: the precondition `length >= 0` -> `length > 0` ----------------
def test_expand_copy_runs_accepts_a_zero_length_run_and_expands_it_to_nothing() -> None:
    assert expand_copy_runs([(3, 7, 0), (5, 9, 2), (0, 0, 0)]) == ([5, 6], [9, 10])
    assert expand_copy_runs([]) == ([], [])


# -- host_pool.HostKVCache._check_pages_to_free: the slot range `+ page_size - 1` -> `+ 1` -----
def test_a_double_host_free_names_the_page_and_its_exact_slot_range() -> None:
    # page size 4 -> hold every page -> free page 1 (slots 4..7) -> free it again: refused,
    # naming page 1 and exactly its slots
    pool = make_host_pool(make_device_pool("mha", SimDevice(), page_size=4), size_tokens=16)
    assert pool.alloc(16) is not None
    page_one = torch.arange(4, 8)
    assert pool.free(page_one) == 4
    with pytest.raises(
        DoubleFreeError,
        match=r"^INV-05: host free got page 1 \(slots 4\.\.7\), which is free already or listed "
        r"twice; free each allocation exactly once$",
    ):
        pool.free(page_one)
    assert pool.allocated_pages() == {0, 2, 3}


# -- page_index.validate_page_aligned_token_indices: the chunk's positions `- 1` -> `- 2` ------
def test_a_misaligned_chunk_names_its_exact_positions_and_the_page_it_should_be() -> None:
    # page size 4 -> chunk 1 holds 5..8 (shifted by one) -> positions 4..7, page 1 = [4..7]
    locs = torch.tensor([0, 1, 2, 3, 5, 6, 7, 8])
    with pytest.raises(PageAlignmentError) as caught:
        validate_page_aligned_token_indices(locs, 4, "host_indices")
    message = str(caught.value)
    assert message.startswith("INV-01: host_indices chunk 1 (positions 4..7) holds ")
    assert "e.g. page 1 = [4..7] (p * page_size + arange(page_size))" in message


# -- host_pool_kinds.make_host_pool: the fallback drops **kwargs----------------------------
def test_make_host_pool_passes_its_arguments_to_the_generic_host_pool() -> None:
    # a device pool whose exact type is no known kind (a subclass) -> the generic HostKVCache,
    # still sized and paged as asked
    device_pool = make_device_pool("mha", SimDevice(), page_size=4)
    device_pool.__class__ = type("SubclassedMHAPool", (MHATokenToKVPool,), {})
    pool = make_host_pool(device_pool, size_tokens=12)
    assert type(pool) is HostKVCache
    assert pool.size == 12 and pool.page_size == 4
