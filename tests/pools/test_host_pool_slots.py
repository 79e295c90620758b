"""Host pool construction and slot bookkeeping: sizes, layouts, whole-page alloc/free, refused
frees that change nothing (INV-01, INV-05, INV-17), policies and the pool-kind match."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ref.device import SimDevice
from hicache_ref.errors import (
    DoubleFreeError,
    ForeignSlotError,
    HiCacheInputError,
    PageAlignmentError,
    UnknownOptionError,
)
from hicache_ref.pools import (
    HostKVCache,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    NSATokenToKVPoolHost,
    make_host_pool,
)

from .builders import make_device_pool, make_pools, pages_to_locs


def host_pool(num_pages: int = 8, page_size: int = 4, **kwargs: object) -> HostKVCache:
    device_pool = make_device_pool("mha", SimDevice(), page_size=page_size)
    return make_host_pool(device_pool, size_tokens=num_pages * page_size, **kwargs)


def pages_of(slots: torch.Tensor, page_size: int = 4) -> list[int]:
    return slots.view(-1, page_size)[:, 0].div(page_size, rounding_mode="floor").tolist()


def test_size_defaults_to_ratio_times_device_size_rounded_up_to_pages() -> None:
    device_pool = make_device_pool("mha", SimDevice(), size=32, page_size=4)
    assert make_host_pool(device_pool).size == 64
    assert make_host_pool(device_pool, host_to_device_ratio=1.1).size == 36
    assert make_host_pool(device_pool, size_tokens=5).size == 8


def test_size_from_host_size_in_gigabytes() -> None:
    device_pool = make_device_pool("mha", SimDevice(), size=32, page_size=4, layer_num=3)
    per_token = device_pool.get_size_per_token()  # 2 * 6 floats * 4 bytes * 3 layers = 144
    pool = make_host_pool(device_pool, host_size=per_token * 40 / 1e9)
    assert pool.size == 40


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("layer_first", (3, 16, 2, 3)),
        ("page_first", (16, 3, 2, 3)),
        ("page_first_direct", (4, 3, 4, 2, 3)),
        ("page_head", (4, 2, 4, 3, 3)),  # (pages, heads, page, layers, head_dim), as upstream
        ("layer_page_first", (3, 4, 4, 2, 3)),  # (layers, pages, page, heads, head_dim)
    ],
)
def test_layouts_shape_the_buffers(layout: str, shape: tuple[int, ...]) -> None:
    _, pool = make_pools("mha", SimDevice(), layout=layout, host_size=16)
    assert isinstance(pool, MHATokenToKVPoolHost)
    assert tuple(pool.k_buffer.shape) == shape and tuple(pool.v_buffer.shape) == shape
    assert not pool.pin_memory


def test_unknown_layout_lists_the_legal_ones() -> None:
    with pytest.raises(
        UnknownOptionError,
        match=r"unknown host layout 'page_first_kv_split'; legal layouts: layer_first, page_first, "
        r"page_first_direct, page_head, layer_page_first$",
    ):
        host_pool(layout="page_first_kv_split")


def test_pinning_needs_cuda() -> None:
    if torch.cuda.is_available():
        assert host_pool(pin_memory=True).buffers["k"].is_pinned()
        return
    with pytest.raises(HiCacheInputError, match="pin_memory=True needs CUDA"):
        host_pool(pin_memory=True)


def test_make_host_pool_picks_the_class_by_device_pool_kind() -> None:
    sim = SimDevice()
    assert type(make_host_pool(make_device_pool("mha", sim))) is MHATokenToKVPoolHost
    assert type(make_host_pool(make_device_pool("mla", sim))) is MLATokenToKVPoolHost
    nsa = make_host_pool(make_device_pool("nsa", sim))
    assert type(nsa) is NSATokenToKVPoolHost
    assert nsa.component_names() == ("kv", "index_k")


def test_mla_host_pool_refuses_an_nsa_device_pool() -> None:
    # sglang#17085: the MLA host pool on an NSA model never backed up the index sidecar
    with pytest.raises(
        HiCacheInputError,
        match="MLATokenToKVPoolHost needs a MLATokenToKVPool, got NSATokenToKVPool",
    ):
        MLATokenToKVPoolHost(make_device_pool("nsa", SimDevice()))


def test_alloc_hands_out_whole_aligned_pages() -> None:
    pool = host_pool(num_pages=4)
    slots = pool.alloc(12)
    assert slots is not None
    assert torch.equal(slots, pages_to_locs(pages_of(slots), 4))
    assert pool.available_size() == 4
    assert pool.alloc(8) is None
    assert pool.available_size() == 4


def test_alloc_refuses_a_partial_page() -> None:
    with pytest.raises(PageAlignmentError, match=r"INV-01: host alloc\(need_size=3\)"):
        host_pool().alloc(3)


def test_free_refuses_misaligned_slots() -> None:
    pool = host_pool()
    slots = pool.alloc(8)
    assert slots is not None
    with pytest.raises(
        PageAlignmentError, match="INV-01: host indices to free has 3 token locations"
    ):
        pool.free(slots[:3])
    with pytest.raises(PageAlignmentError, match="INV-01: host indices to free chunk 0"):
        pool.free(slots[1:5])
    assert pool.allocated_pages() == set(pages_of(slots))


def test_free_refuses_double_free_and_foreign_slots_all_or_nothing() -> None:
    # hold pages a, b -> free a -> free [b, a]: refused, b stays held (INV-05, INV-17)
    pool = host_pool(num_pages=8)
    slots = pool.alloc(8)
    assert slots is not None
    assert pool.free(slots[:4]) == 4
    held_before = pool.allocated_pages()
    with pytest.raises(DoubleFreeError, match=r"INV-05: host free got page \d+ .* free already"):
        pool.free(torch.cat([slots[4:], slots[:4]]))
    with pytest.raises(DoubleFreeError, match="listed twice"):
        pool.free(torch.cat([slots[4:], slots[4:]]))
    with pytest.raises(
        ForeignSlotError,
        match=r"INV-05: host free got page 8 .* outside this pool's pages \[0, 8\)",
    ):
        pool.free(torch.cat([slots[4:], pages_to_locs([8], 4)]))
    with pytest.raises(ForeignSlotError, match="page -1"):
        pool.free(torch.tensor([-4, -3, -2, -1]))
    assert pool.allocated_pages() == held_before
    assert pool.free_slot_count() == 7 * 4


def test_lifo_reuses_a_freed_page_at_once_and_fifo_last() -> None:
    for policy, reused in (("lifo", True), ("fifo", False)):
        pool = host_pool(num_pages=4, alloc_policy=policy)
        first = pool.alloc(4)
        assert first is not None
        pool.free(first)
        second = pool.alloc(4)
        assert second is not None
        assert torch.equal(first, second) is reused, policy


def test_random_host_policy_is_seeded() -> None:
    def order(seed: int) -> list[int]:
        pool = host_pool(num_pages=16, alloc_policy="random", seed=seed)
        slots = pool.alloc(64)
        assert slots is not None
        return pages_of(slots)

    assert order(1) == order(1) and order(1) != order(2)


def test_alloc_contiguous_preferred_finds_a_run_in_a_fragmented_pool() -> None:
    pool = host_pool(num_pages=6)
    slots = pool.alloc(24)
    assert slots is not None
    pool.free(pages_to_locs([0, 2, 3, 5], 4))
    run = pool.alloc_contiguous_preferred(8)
    assert run is not None and run.tolist() == list(range(8, 16))
    # no run of two pages is left: fall back to any two pages
    rest = pool.alloc_contiguous_preferred(8)
    assert rest is not None and sorted(pages_of(rest)) == [0, 5]
    assert pool.alloc_contiguous_preferred(4) is None


def test_clear_frees_everything() -> None:
    pool = host_pool(num_pages=4)
    assert pool.alloc(16) is not None
    pool.clear()
    assert pool.available_size() == 16 and pool.allocated_pages() == set()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=3)), max_size=30))
def test_every_host_page_is_free_or_held_once(steps: list[tuple[bool, int]]) -> None:
    pool = host_pool(num_pages=6, alloc_policy="lifo")
    held: list[torch.Tensor] = []
    for is_alloc, amount in steps:
        if is_alloc:
            slots = pool.alloc_contiguous_preferred(amount * 4)
            if slots is not None:
                held.append(slots)
        elif held:
            pool.free(held.pop(amount % len(held)))
        held_pages = [page for slots in held for page in pages_of(slots)]
        assert len(held_pages) == len(set(held_pages))
        assert set(held_pages) == pool.allocated_pages()
        assert pool.free_slot_count() + 4 * len(held_pages) == pool.size
