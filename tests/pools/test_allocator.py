"""The device page allocator: page 0 reserved, whole pages, refused frees change nothing,
owner-pattern replay and the handout policies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_ref.errors import (
    DoubleFreeError,
    ForeignSlotError,
    HiCacheInputError,
    PageAlignmentError,
    UnknownOptionError,
)
from hicache_ref.pools import (
    CpSharedKVLayout,
    PagedTokenToKVPoolAllocator,
    PageFreeList,
    TokenToKVPoolAllocator,
)

from .builders import pages_to_locs


def make_allocator(
    num_pages: int = 4, page_size: int = 4, **kwargs: object
) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(
        num_pages * page_size,
        page_size,
        torch.float32,
        "cpu",
        None,
        **kwargs,  # type: ignore[arg-type]
    )


def pages_of(locs: torch.Tensor, page_size: int = 4) -> list[int]:
    return locs.view(-1, page_size)[:, 0].div(page_size, rounding_mode="floor").tolist()


def test_alloc_hands_out_whole_pages_and_never_page_zero() -> None:
    allocator = make_allocator(num_pages=4)
    locs = allocator.alloc(16)
    assert locs is not None
    assert locs.dtype == torch.int64 and locs.device.type == "cpu"
    assert torch.equal(locs, pages_to_locs(pages_of(locs), 4))
    assert sorted(pages_of(locs)) == [1, 2, 3, 4]
    assert allocator.available_size() == 0
    # the pool is empty: a shortfall is a value, not an exception
    assert allocator.alloc(4) is None


def test_alloc_of_zero_tokens_is_empty() -> None:
    locs = make_allocator().alloc(0)
    assert locs is not None and locs.numel() == 0


def test_alloc_refuses_a_partial_page() -> None:
    with pytest.raises(PageAlignmentError, match=r"INV-01: alloc\(need_size=6\) .* page_size=4"):
        make_allocator().alloc(6)


def test_size_must_be_a_page_multiple() -> None:
    with pytest.raises(PageAlignmentError, match="INV-01: allocator size=10"):
        PagedTokenToKVPoolAllocator(10, 4, torch.float32, "cpu", None)


def test_free_of_a_partial_page_frees_the_whole_page() -> None:
    allocator = make_allocator()
    locs = allocator.alloc(8)
    assert locs is not None
    allocator.free(locs[:1])
    assert allocator.available_size() == 12
    assert pages_of(locs)[0] in allocator.free_page_ids()


def test_free_refuses_double_free_and_changes_nothing() -> None:
    # alloc 2 pages -> free one -> free both: refused, the still-held page stays held (INV-17)
    allocator = make_allocator()
    locs = allocator.alloc(8)
    assert locs is not None
    allocator.free(locs[:4])
    before = (allocator.free_page_ids(), allocator.allocated_page_ids(), allocator.available_size())
    with pytest.raises(DoubleFreeError, match=r"INV-05: free\(\) got page \d+ .* free already"):
        allocator.free(locs)
    assert (
        allocator.free_page_ids(),
        allocator.allocated_page_ids(),
        allocator.available_size(),
    ) == before


def test_free_refuses_page_zero_and_foreign_pages() -> None:
    allocator = make_allocator(num_pages=4)
    locs = allocator.alloc(4)
    assert locs is not None
    before = allocator.free_page_ids()
    with pytest.raises(
        ForeignSlotError, match=r"INV-05: free\(\) got page 0 .* reserved for padded tokens"
    ):
        allocator.free(torch.cat([locs, torch.tensor([0, 1, 2, 3])]))
    with pytest.raises(ForeignSlotError, match=r"outside this allocator's pages \[1, 4\]"):
        allocator.free(torch.tensor([20, 21, 22, 23]))
    with pytest.raises(ForeignSlotError, match="page -1"):
        allocator.free(torch.tensor([-1]))
    assert allocator.free_page_ids() == before


def test_fifo_hands_out_the_oldest_freed_page_and_lifo_the_newest() -> None:
    # alloc pages 1, 2 -> free page 1 -> next alloc: fifo takes 3 (older free), lifo reuses 1 at once
    for policy, expected in (("fifo", 3), ("lifo", 1)):
        allocator = make_allocator(alloc_policy=policy)
        first = allocator.alloc(8)
        assert first is not None and pages_of(first) == [1, 2]
        allocator.free(first[:4])
        again = allocator.alloc(4)
        assert again is not None and pages_of(again) == [expected], policy


def test_lifo_reuses_the_first_page_of_the_last_free_first() -> None:
    allocator = make_allocator(num_pages=4, alloc_policy="lifo")
    locs = allocator.alloc(16)
    assert locs is not None
    allocator.free(pages_to_locs([3, 1], 4))
    allocator.free(pages_to_locs([2], 4))
    again = allocator.alloc(12)
    assert again is not None and pages_of(again) == [2, 1, 3]


def test_random_policy_is_seeded() -> None:
    def sequence(seed: int) -> list[int]:
        allocator = make_allocator(num_pages=32, alloc_policy="random", seed=seed)
        locs = allocator.alloc(32 * 4)
        assert locs is not None
        return pages_of(locs)

    assert sequence(3) == sequence(3)
    assert sorted(sequence(3)) == list(range(1, 33))
    assert sequence(3) != sequence(4)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(
        UnknownOptionError, match="unknown alloc_policy 'best'; legal values: fifo, lifo, random"
    ):
        make_allocator(alloc_policy="best")


def test_alloc_pages_with_owners_replays_the_pattern() -> None:
    layout = CpSharedKVLayout(cp_size=2, cp_rank=0, page_size=4)
    allocator = make_allocator(num_pages=8, cp_layout=layout)
    locs = allocator.alloc_pages_with_owners([1, 0, 1, 1])
    assert locs is not None
    pages = pages_of(locs)
    assert [page % 2 for page in pages] == [1, 0, 1, 1]
    assert torch.equal(locs, pages_to_locs(pages, 4))
    assert layout.owner_for_logical_pages(torch.tensor(pages)).tolist() == [1, 0, 1, 1]


def test_alloc_pages_with_owners_short_class_changes_nothing() -> None:
    # 8 pages: owner 0 has pages 2, 4, 6, 8; asking five of owner 0 fails, even with owner 1 free
    allocator = make_allocator(num_pages=8, cp_layout=CpSharedKVLayout(2, 1, 4))
    before = allocator.free_page_ids()
    assert allocator.alloc_pages_with_owners([0, 0, 0, 0, 0]) is None
    assert allocator.free_page_ids() == before


def test_alloc_pages_with_owners_refuses_owners_outside_the_group() -> None:
    allocator = make_allocator(num_pages=8, cp_layout=CpSharedKVLayout(2, 0, 4))
    with pytest.raises(
        HiCacheInputError,
        match=r"page_owners\[1\]=2 is not a CP rank; owners must be in \[0, cp_size\) = \[0, 2\)",
    ):
        allocator.alloc_pages_with_owners([0, 2])
    # without a CP layout only owner 0 exists
    with pytest.raises(HiCacheInputError, match=r"\[0, 1\)"):
        make_allocator().alloc_pages_with_owners([1])


def test_cp_layout_must_share_the_page_size() -> None:
    with pytest.raises(HiCacheInputError, match=r"cp_layout\.page_size=8 differs"):
        make_allocator(cp_layout=CpSharedKVLayout(2, 0, 8))


def test_need_sort_holds_frees_until_needed_then_hands_them_out_sorted() -> None:
    allocator = make_allocator(num_pages=4, need_sort=True)
    locs = allocator.alloc(16)
    assert locs is not None
    allocator.free(pages_to_locs([4], 4))
    allocator.free(pages_to_locs([2], 4))
    assert allocator.available_size() == 8
    with pytest.raises(DoubleFreeError):
        allocator.free(pages_to_locs([2], 4))
    again = allocator.alloc(8)
    assert again is not None and pages_of(again) == [2, 4]


def test_token_allocator_reserves_slot_zero() -> None:
    allocator = TokenToKVPoolAllocator(4, torch.float32, "cpu", None)
    locs = allocator.alloc(4)
    assert locs is not None and sorted(locs.tolist()) == [1, 2, 3, 4]
    with pytest.raises(ForeignSlotError, match="page 0"):
        allocator.free(torch.tensor([0]))


def test_get_kvcache_without_a_pool_is_an_input_error() -> None:
    with pytest.raises(HiCacheInputError, match="kvcache=None"):
        make_allocator().get_kvcache()


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/owner-alloc sequences keep every page free xor held once (INV-05)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = make_allocator(
            num_pages=9, page_size=2, alloc_policy="lifo", cp_layout=CpSharedKVLayout(3, 0, 2)
        )
        self.held: list[torch.Tensor] = []

    @rule(num_pages=st.integers(min_value=0, max_value=4))
    def alloc(self, num_pages: int) -> None:
        before = self.allocator.available_size()
        locs = self.allocator.alloc(num_pages * 2)
        if locs is None:
            assert before < num_pages * 2
        else:
            self.held.append(locs)

    @rule(owners=st.lists(st.integers(min_value=0, max_value=2), max_size=4))
    def alloc_with_owners(self, owners: list[int]) -> None:
        locs = self.allocator.alloc_pages_with_owners(owners)
        if locs is not None:
            assert [page % 3 for page in pages_of(locs, 2)] == owners
            self.held.append(locs)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        locs = self.held.pop(data.draw(st.integers(min_value=0, max_value=len(self.held) - 1)))
        self.allocator.free(locs)

    @precondition(lambda self: any(locs.numel() > 0 for locs in self.held))
    @rule()
    def double_free_is_refused(self) -> None:
        position = next(i for i, locs in enumerate(self.held) if locs.numel() > 0)
        locs = self.held.pop(position)
        self.allocator.free(locs)
        before = self.allocator.free_page_ids()
        with pytest.raises(DoubleFreeError):
            self.allocator.free(locs)
        assert self.allocator.free_page_ids() == before

    @invariant()
    def pages_are_conserved(self) -> None:
        held = [page for locs in self.held for page in pages_of(locs, 2)]
        assert len(held) == len(set(held))
        assert set(held) == self.allocator.allocated_page_ids()
        assert len(held) + len(self.allocator.free_page_ids()) == 9
        assert 0 not in held


AllocatorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["fifo", "lifo", "random"]),
    owners=st.integers(1, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["take", "owners", "run", "push", "reset"]), st.integers(0, 5))
    ),
)
def test_the_taken_set_kept_by_takes_and_pushes_is_the_complement_of_the_free_list(
    policy: str, owners: int, ops: list[tuple[str, int]]
) -> None:
    # the snapshot's page sets are kept incrementally, never rebuilt from the free lists
    free_list = PageFreeList(range(1, 13), alloc_policy=policy, seed=3, num_owner_classes=owners)
    held: list[int] = []
    for op, n in ops:
        if op == "take":
            held += free_list.take(n) or []
        elif op == "owners":
            held += free_list.take_with_owners([i % owners for i in range(n)]) or []
        elif op == "run":
            run = free_list.find_free_run(n + 1)
            if run is not None:
                free_list.take_specific(run)
                held += run
        elif op == "push" and held:
            freed, held = held[:n], held[n:]
            free_list.push(freed)
        elif op == "reset":
            free_list.reset()
            held = []
        assert free_list.taken_pages() == set(range(1, 13)) - set(free_list.sorted_pages())
        assert free_list.taken_pages() == set(held)


def test_allocated_pages_leave_out_the_release_list() -> None:
    allocator = make_allocator(num_pages=4, need_sort=True)
    locs = allocator.alloc(12)
    assert locs is not None and allocator.allocated_page_ids() == {1, 2, 3}
    allocator.free(locs[:4])  # page 1 waits in the release list: free, yet not in the free list
    assert allocator.allocated_page_ids() == {2, 3} and allocator.is_page_free(1)
    allocator.merge_and_sort_free()
    assert allocator.allocated_page_ids() == {2, 3}
