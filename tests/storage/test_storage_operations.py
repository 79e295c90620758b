"""Storage operations: published progress, termination, and the INV-19 release ledger."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import is_violation_of
from hicache_ref.storage.operations import (
    PrefetchOperation,
    StorageOperation,
    compute_prefetch_split,
    is_valid_prefetch_split,
)
from hicache_ref.storage.queues import BoundedQueue, StorageQueueOverflow


def op(tokens: int = 8, page_size: int = 2) -> PrefetchOperation:
    operation = PrefetchOperation("r", list(range(tokens)), page_size=page_size)
    operation.host_indices = torch.arange(tokens)
    return operation


def test_a_prefetch_has_no_bounce_buffer_until_the_tree_gives_it_one() -> None:
    operation = PrefetchOperation("r", [1, 2, 3, 4], page_size=2)
    assert operation.host_indices is None and operation.bounce_buffer_tokens == 0
    assert not operation.hit_known and operation.storage_hit_count == 0


def test_published_progress_grows_in_whole_pages() -> None:
    operation = op()
    operation.completed_tokens = 4
    with pytest.raises(AssertionError) as info:
        operation.completed_tokens = 5
    assert is_violation_of(info.value, "INV-19")
    with pytest.raises(AssertionError, match="only grows"):
        operation.completed_tokens = 2


def test_progress_is_frozen_once_terminated() -> None:
    operation = op()
    operation.completed_tokens = 2
    operation.mark_terminate()
    operation.completed_tokens = 2  # the same value is no change
    with pytest.raises(AssertionError, match="2 -> 4 after termination"):
        operation.completed_tokens = 4
    assert operation.frozen_completed_tokens == 2 and operation.is_terminated()


def test_a_slot_released_twice_is_an_inv19_violation() -> None:
    # sglang#13483: host_indices[completed:] released in two places
    operation = op()
    operation.record_release(4, 8, "controller")
    with pytest.raises(AssertionError, match="overlaps \\[4:8\\) released by controller"):
        operation.record_release(6, 8, "tree")


def test_release_of_a_partial_page_is_refused() -> None:
    with pytest.raises(AssertionError, match="not whole pages"):
        op().record_release(1, 4, "tree")


def test_split_covers_the_buffer_once() -> None:
    split = compute_prefetch_split(16, 4, 8, 12)
    ranges = [split.freed_by_tree, split.inserted, split.released_by_tree]
    ranges.append(split.released_by_controller)
    covered = [t for start, end in ranges for t in range(start, end)]
    assert covered == list(range(16))
    assert is_valid_prefetch_split(16, 4, 8, 12, page_size=4)
    assert not is_valid_prefetch_split(16, 8, 4, 12, page_size=4)
    assert not is_valid_prefetch_split(16, 4, 8, 10, page_size=4)


def test_operation_copies_prefix_keys_so_the_caller_list_is_never_extended() -> None:
    prefix = ["p0"]
    operation = StorageOperation(torch.arange(2), [1, 2], prefix_keys=prefix)
    prefix.append("p1")
    assert operation.prefix_keys == ("p0",)


def test_operation_ids_increase() -> None:
    first, second = op(), op()
    assert second.id > first.id and first < second


def test_bounded_queue_refuses_a_put_beyond_its_bound() -> None:
    bounded: BoundedQueue[int] = BoundedQueue("q", 2, "drain it")
    bounded.put(1)
    bounded.put(2)
    with pytest.raises(StorageQueueOverflow, match="q holds 2 items, its bound \\(drain it\\)"):
        bounded.put(3)
    assert bounded.clear() == [1, 2] and bounded.empty()


def test_bounded_queue_poll_returns_none_when_idle_or_woken() -> None:
    bounded: BoundedQueue[int] = BoundedQueue("q", 2, "drain it")
    assert bounded.poll(0.001) is None
    bounded.wake_all()
    assert bounded.poll(0.001) is None
    bounded.put(5)
    assert bounded.get(timeout=0.001) == 5
