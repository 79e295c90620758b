"""Storage page I/O: one flat byte order for every layout (bug class 21), every component in
the page (sglang#17085), and page starts checked (INV-01).

Upstream's page bytes follow each layout's buffer (``page_head``: ``(2, H, page, L, D)``); here
every layout, ``page_head`` and ``layer_page_first`` included, reads and writes the one order
``component, layer, token, *row``, so a page stored under one layout loads under any other."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, PageAlignmentError
from hicache_ref.pools import HostKVCache

from .builders import (
    POOL_KINDS,
    fill_device_rows,
    fill_with_sentinel,
    layouts_for_kind,
    make_pools,
    pages_to_locs,
    row_values,
)
from .test_host_transfers import LEGAL_CASES

PAGE = 4


def fill_host_page(pool: HostKVCache, page: int, seed: int) -> None:
    """Distinctive rows for every component and layer of one host page."""
    slots = pages_to_locs([page], PAGE)
    for c_index, component in enumerate(pool.component_names()):
        row_shape = pool.row_shapes[component]
        for layer in range(pool.layer_num):
            numel = PAGE * int(torch.tensor(row_shape).prod())
            values = (
                seed * 1000
                + c_index * 100
                + layer * 10
                + torch.arange(numel, dtype=torch.float32) / 64
            )
            pool.write_rows(component, layer, slots, values.view(PAGE, *row_shape))


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_flat_page_is_the_same_for_every_layout(kind: str) -> None:
    pages = []
    for layout in layouts_for_kind(kind):
        _, pool = make_pools(kind, SimDevice(), layout=layout, page_size=PAGE)
        fill_host_page(pool, 3, seed=1)
        pages.append(pool.get_data_page(3 * PAGE))
    assert all(torch.equal(pages[0], other) for other in pages[1:])
    assert pages[0].numel() == pool.get_flat_page_numel()


def test_flat_page_order_is_component_then_layer_then_token() -> None:
    _, pool = make_pools("nsa", SimDevice(), layout="page_first_direct", page_size=PAGE)
    fill_host_page(pool, 1, seed=2)
    flat = pool.get_data_page(PAGE)
    kv_numel = pool.layer_num * PAGE * 5
    slots = pages_to_locs([1], PAGE)
    assert torch.equal(flat[: PAGE * 5], pool.read_rows("kv", 0, slots).reshape(-1))
    assert torch.equal(
        flat[kv_numel : kv_numel + PAGE * 4], pool.read_rows("index_k", 0, slots).reshape(-1)
    )


CROSS_LAYOUT_CASES = [
    (kind, source, target)
    for kind in POOL_KINDS
    for source in layouts_for_kind(kind)
    for target in layouts_for_kind(kind)
]


@pytest.mark.parametrize(("kind", "source_layout", "target_layout"), CROSS_LAYOUT_CASES)
def test_a_page_stored_under_one_layout_reads_back_under_another(
    kind: str, source_layout: str, target_layout: str
) -> None:
    _, source = make_pools(kind, SimDevice(), layout=source_layout, page_size=PAGE)
    _, target = make_pools(kind, SimDevice(), layout=target_layout, page_size=PAGE)
    fill_host_page(source, 2, seed=3)
    target.set_from_flat_data_page(5 * PAGE, source.get_data_page(2 * PAGE))
    for component in source.component_names():
        for layer in range(source.layer_num):
            assert torch.equal(
                target.read_rows(component, layer, pages_to_locs([5], PAGE)),
                source.read_rows(component, layer, pages_to_locs([2], PAGE)),
            )
    # the neighbouring pages were not touched
    assert not target.read_rows(
        "kv" if kind != "mha" else "k", 0, pages_to_locs([4, 6], PAGE)
    ).any()


@pytest.mark.parametrize(("io_backend", "layout", "kind"), LEGAL_CASES)
@pytest.mark.parametrize("copy_path", ["gather", "runs"])
def test_storage_page_round_trip_device_host_storage_host_device(
    io_backend: str, layout: str, kind: str, copy_path: str
) -> None:
    # d2h -> get_data_page (to storage) -> set_from_flat_data_page into a fresh pool's other
    # pages (from storage) -> h2d per layer into other device pages -> the original bytes
    sim = SimDevice()
    device_pool, host_pool = make_pools(kind, sim, layout=layout, copy_path=copy_path)
    _, restored = make_pools(kind, sim, layout=layout, copy_path=copy_path)
    fill_with_sentinel(device_pool, host_pool)
    device_locs = pages_to_locs([5, 2], PAGE)
    fill_device_rows(device_pool, device_locs, seed=6)
    host_pool.backup_from_device_all_layer(
        device_pool, pages_to_locs([3, 0], PAGE), device_locs, io_backend
    )
    sim.run_until_idle()
    for source, target in ((3, 9), (0, 4)):
        stored = host_pool.get_data_page(source * PAGE).clone()
        assert stored.numel() == restored.get_dummy_flat_data_page().numel()
        restored.set_from_flat_data_page(target * PAGE, stored)
    load_locs = pages_to_locs([1, 6], PAGE)
    for layer in range(device_pool.layer_num):
        restored.load_to_device_per_layer(
            device_pool, pages_to_locs([9, 4], PAGE), load_locs, layer, io_backend
        )
    sim.run_until_idle()
    for component in device_pool.component_names():
        for layer in range(device_pool.layer_num):
            expected = row_values(device_pool, component, layer, device_locs, seed=6)
            assert torch.equal(device_pool.read_rows(component, layer, load_locs), expected)


def test_get_data_page_is_a_copy() -> None:
    _, pool = make_pools("mha", SimDevice(), page_size=PAGE)
    page = pool.get_data_page(0)
    page.fill_(5.0)
    assert not pool.read_rows("k", 0, pages_to_locs([0], PAGE)).any()


def test_dummy_page_has_the_flat_size_and_dtype() -> None:
    _, pool = make_pools("nsa", SimDevice(), page_size=PAGE)
    dummy = pool.get_dummy_flat_data_page()
    assert dummy.shape == (pool.layer_num * PAGE * (5 + 4),) and dummy.dtype == pool.dtype
    assert not dummy.any()


def test_unflat_page_stacks_components_of_one_row_shape() -> None:
    _, pool = make_pools("mha", SimDevice(), layout="page_first", page_size=PAGE)
    fill_host_page(pool, 1, seed=4)
    page = pool.get_data_page(PAGE, flat=False)
    assert page.shape == (2, pool.layer_num, PAGE, 2, 3)
    assert torch.equal(page.reshape(-1), pool.get_data_page(PAGE))
    _, nsa = make_pools("nsa", SimDevice(), page_size=PAGE)
    with pytest.raises(HiCacheInputError, match=r"get_data_page\(flat=False\) needs one row shape"):
        nsa.get_data_page(0, flat=False)


def test_page_index_must_be_an_aligned_slot_of_the_pool() -> None:
    _, pool = make_pools("mla", SimDevice(), page_size=PAGE)
    with pytest.raises(PageAlignmentError, match="INV-01: page index 6 is not a page start"):
        pool.get_data_page(6)
    with pytest.raises(
        HiCacheInputError, match=r"page index 64 is outside this host pool's slots \[0, 64\)"
    ):
        pool.set_from_flat_data_page(64, pool.get_dummy_flat_data_page())


def test_a_flat_page_of_the_wrong_size_or_dtype_is_refused() -> None:
    _, pool = make_pools("mla", SimDevice(), page_size=PAGE)
    with pytest.raises(
        HiCacheInputError, match=r"a flat data page must have 60 elements of torch\.float32"
    ):
        pool.set_from_flat_data_page(0, torch.zeros(59))
    with pytest.raises(HiCacheInputError, match=r"got 60 of torch\.float64"):
        pool.set_from_flat_data_page(0, torch.zeros(60, dtype=torch.float64))
