"""The host layouts themselves: which (io_backend, layout, pool kind) may exist, where a row of
``page_head`` and ``layer_page_first`` lives in its buffer, and copy runs that never cross a host
page of a page-local layout."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.pools import (
    HOST_LAYOUTS,
    LAYOUTS_BY_IO_BACKEND,
    HostKVCache,
    MLATokenToKVPoolHost,
    NSATokenToKVPoolHost,
    make_host_pool,
)
from hicache_ref.pools.host_layout import LAYOUTS_BY_POOL_KIND, HostLayout, host_run_view
from hicache_ref.pools.transfer import Direction, plan_runs

from .builders import ALL_LAYOUTS, POOL_KINDS, layouts_for_kind, make_device_pool, make_pools
from .test_host_transfers import LEGAL_PAIRS

PAGE = 4


def test_the_layout_tables_are_the_legal_pairs_and_kinds() -> None:
    assert HOST_LAYOUTS == ALL_LAYOUTS
    assert [(b, layout) for b, layouts in LAYOUTS_BY_IO_BACKEND.items() for layout in layouts] == [
        *LEGAL_PAIRS
    ]
    assert {kind: LAYOUTS_BY_POOL_KIND[kind] for kind in POOL_KINDS} == {
        kind: layouts_for_kind(kind) for kind in POOL_KINDS
    }


@pytest.mark.parametrize("kind", ["mla", "nsa"])
def test_page_head_is_refused_for_mla_pools_naming_the_legal_layouts(kind: str) -> None:
    # upstream 0.5.10 defines page_head for MHA host pools only
    device_pool = make_device_pool(kind, SimDevice())
    pool_name = type(device_pool).__name__
    message = (
        f"^host layout 'page_head' is MHA-only and cannot hold a {pool_name}; legal layouts for "
        "it: layer_first, page_first, page_first_direct, layer_page_first$"
    )
    with pytest.raises(HiCacheInputError, match=message):
        make_host_pool(device_pool, layout="page_head", size_tokens=16)
    host_class = MLATokenToKVPoolHost if kind == "mla" else NSATokenToKVPoolHost
    with pytest.raises(HiCacheInputError, match=message):
        host_class(device_pool, layout="page_head", size_tokens=16)


def test_the_generic_host_pool_takes_page_head_only_for_mha() -> None:
    mha = HostKVCache(make_device_pool("mha", SimDevice()), layout="page_head", size_tokens=16)
    assert tuple(mha.buffers["k"].shape) == (4, 2, PAGE, 3, 3)
    with pytest.raises(HiCacheInputError, match="'page_head' is MHA-only"):
        HostKVCache(make_device_pool("mla", SimDevice()), layout="page_head", size_tokens=16)


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_layer_page_first_takes_every_pool_kind(kind: str) -> None:
    _, pool = make_pools(kind, SimDevice(), layout="layer_page_first", host_size=16)
    for name, row_shape in pool.row_shapes.items():
        assert tuple(pool.buffers[name].shape) == (pool.layer_num, 4, PAGE, *row_shape)


def test_a_page_head_row_lives_at_page_head_page_offset_layer() -> None:
    # write_rows(slot 6, layer 2) -> buf[6 // 4, :, 6 % 4, 2] (upstream's (P, H, page, L, D))
    _, pool = make_pools("mha", SimDevice(), layout="page_head", host_size=16)
    row = torch.arange(6, dtype=torch.float32).view(1, 2, 3) + 1
    pool.write_rows("v", 2, torch.tensor([6]), row)
    buffer = pool.buffers["v"]
    assert torch.equal(buffer[1, :, 2, 2], row[0])
    assert int(buffer.count_nonzero()) == row.numel()
    assert torch.equal(pool.read_rows("v", 2, torch.tensor([6])), row)
    # one page holds every layer of one head contiguously (what a head split of a page needs)
    assert buffer[1, 0].is_contiguous() and buffer[1, 0].shape == (PAGE, 3, 3)


def test_a_layer_page_first_row_lives_at_layer_page_offset() -> None:
    _, pool = make_pools("nsa", SimDevice(), layout="layer_page_first", host_size=16)
    row = torch.arange(4, dtype=torch.float32).view(1, 1, 4) + 1
    pool.write_rows("index_k", 1, torch.tensor([13]), row)
    buffer = pool.buffers["index_k"]
    assert torch.equal(buffer[1, 3, 1], row[0])
    assert int(buffer.count_nonzero()) == row.numel()


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head", "layer_page_first"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_runs_are_split_at_host_pages_for_page_local_layouts(
    layout: HostLayout, direction: Direction
) -> None:
    # host slots 2..9 and device locs 20..27 are one run; it is cut where a host page ends
    host = torch.arange(2, 10)
    device = torch.arange(20, 28)
    runs = plan_runs(host, device, direction=direction, layout=layout, page_size=PAGE)
    host_starts = [run[1] if direction == "d2h" else run[0] for run in runs]
    assert host_starts == [2, 4, 8]
    assert [run[2] for run in runs] == [2, 4, 2]


def test_runs_cross_host_pages_for_layer_first() -> None:
    runs = plan_runs(
        torch.arange(2, 10),
        torch.arange(20, 28),
        direction="d2h",
        layout="layer_first",
        page_size=4,
    )
    assert runs == [(20, 2, 8)]


def test_a_page_head_run_view_is_rows_of_one_page_and_refuses_to_cross_it() -> None:
    _, pool = make_pools("mha", SimDevice(), layout="page_head", host_size=16)
    slots = torch.arange(5, 8)
    values = torch.arange(3 * 6, dtype=torch.float32).view(3, 2, 3) + 1
    pool.write_rows("k", 1, slots, values)
    view = host_run_view("page_head", pool.buffers["k"], 1, 5, 3, PAGE)
    assert torch.equal(view, values)
    with pytest.raises(InvariantViolation, match="INV-01 violated: a page_head copy run 6\\+3"):
        host_run_view("page_head", pool.buffers["k"], 1, 6, 3, PAGE)


@pytest.mark.parametrize("layout", layouts_for_kind("mha"))
def test_every_layout_reads_back_what_write_rows_wrote(layout: str) -> None:
    _, pool = make_pools("mha", SimDevice(), layout=layout, host_size=16)
    slots = torch.tensor([13, 2, 7, 8])
    values = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(1))
    pool.write_rows("k", 2, slots, values)
    assert torch.equal(pool.read_rows("k", 2, slots), values)
    assert not pool.read_rows("k", 1, slots).any()
