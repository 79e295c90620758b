"""Host <-> device transfers on SimDevice: every byte of every component round-trips for every
layout x io backend x pool kind x page size (INV-06), rows not selected stay untouched, no byte
moves before the stream runs, and bad transfers are refused at launch with nothing queued.

The legal pairs: ``direct`` drives ``layer_first``, ``page_first_direct`` (upstream 0.5.10) and
``layer_page_first`` (the CP/draft fork); ``kernel`` drives ``layer_first``, ``page_first`` and
``page_head`` (upstream 0.5.10, MHA pools only)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_ref.campaign.failures import get_failure_invariant
from hicache_ref.device import SimDevice
from hicache_ref.errors import (
    HiCacheInputError,
    IndexOutsidePoolError,
    LayerOutsidePoolError,
    LayerRangeError,
    PageAlignmentError,
    UnknownOptionError,
)
from hicache_ref.pools import HostKVCache, KVCache

from .builders import (
    ALL_LAYOUTS,
    MHA_ONLY_LAYOUTS,
    POOL_KINDS,
    SENTINEL,
    fill_device_rows,
    fill_with_sentinel,
    make_device_pool,
    make_pools,
    pages_to_locs,
    row_values,
)

LEGAL_PAIRS = [
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
    ("direct", "layer_page_first"),
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "page_head"),
]
LEGAL_CASES = [
    (io_backend, layout, kind)
    for io_backend, layout in LEGAL_PAIRS
    for kind in POOL_KINDS
    if kind == "mha" or layout not in MHA_ONLY_LAYOUTS
]
"""Every legal (io_backend, layout, pool kind): page_head only with MHA pools."""
ILLEGAL_PAIRS = [
    (io_backend, layout)
    for io_backend in ("direct", "kernel")
    for layout in ALL_LAYOUTS
    if (io_backend, layout) not in LEGAL_PAIRS
]
LEGAL_PAIRS_TEXT = (
    "direct: layer_first, page_first_direct, layer_page_first; "
    "kernel: layer_first, page_first, page_head"
)
WHOLE_PAGE_LAYOUTS = ["page_first_direct", "layer_page_first"]  # direct moves them page by page
NUM_PAGES = 8


def kind_for(layout: str) -> str:
    """A pool kind that can take ``layout`` and has the most components (NSA, else MHA)."""
    return "mha" if layout in MHA_ONLY_LAYOUTS else "nsa"


def device_snapshot(pool: KVCache) -> dict[tuple[str, int], torch.Tensor]:
    """Every row of every component and layer of a device pool."""
    rows = torch.arange(pool.size + pool.page_size)
    return {
        (c, layer): pool.read_rows(c, layer, rows)
        for c in pool.component_names()
        for layer in range(pool.layer_num)
    }


def host_snapshot(pool: HostKVCache) -> dict[tuple[str, int], torch.Tensor]:
    """Every row of every component and layer of a host pool (layout-independent)."""
    rows = torch.arange(pool.size)
    return {
        (c, layer): pool.read_rows(c, layer, rows)
        for c in pool.component_names()
        for layer in range(pool.layer_num)
    }


def scatter(
    snapshot: dict[tuple[str, int], torch.Tensor],
    rows: torch.Tensor,
    values: dict[tuple[str, int], torch.Tensor],
    layers: list[int],
) -> dict[tuple[str, int], torch.Tensor]:
    """``snapshot`` with ``rows`` of ``layers`` replaced by ``values`` (the expected result)."""
    expected = {key: tensor.clone() for key, tensor in snapshot.items()}
    for (component, layer), tensor in expected.items():
        if layer in layers:
            tensor[rows] = values[(component, layer)]
    return expected


def assert_same(
    actual: dict[tuple[str, int], torch.Tensor], expected: dict[tuple[str, int], torch.Tensor]
) -> None:
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), f"component/layer {key} differs"


@pytest.mark.parametrize(("io_backend", "layout", "kind"), LEGAL_CASES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("copy_path", ["gather", "runs"])
@pytest.mark.parametrize("per_layer_backup", [False, True])
def test_round_trip_moves_every_component_and_nothing_else(
    io_backend: str, layout: str, kind: str, page_size: int, copy_path: str, per_layer_backup: bool
) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_pools(
        kind,
        sim,
        page_size=page_size,
        layout=layout,
        copy_path=copy_path,
        device_size=NUM_PAGES * page_size,
        host_size=NUM_PAGES * page_size,
    )
    layers = list(range(device_pool.layer_num))
    fill_with_sentinel(device_pool, host_pool)
    # unordered, non-contiguous page sets on both sides
    device_locs = pages_to_locs([5, 2, 7, 8], page_size)
    host_slots = pages_to_locs([6, 1, 3, 2], page_size)
    fill_device_rows(device_pool, device_locs, seed=1)
    written = {
        (c, layer): row_values(device_pool, c, layer, device_locs, seed=1)
        for c in device_pool.component_names()
        for layer in layers
    }
    host_before = host_snapshot(host_pool)

    # d2h on a write stream: queued, not run
    write_stream = sim.Stream()
    with sim.stream(write_stream):
        if per_layer_backup:
            for layer in layers:
                host_pool.backup_from_device_per_layer(
                    device_pool, host_slots, device_locs, layer, io_backend
                )
        else:
            host_pool.backup_from_device_all_layer(device_pool, host_slots, device_locs, io_backend)
    assert write_stream.pending == (len(layers) if per_layer_backup else 1)
    assert_same(host_snapshot(host_pool), host_before)
    sim.run_until_idle()
    assert_same(host_snapshot(host_pool), scatter(host_before, host_slots, written, layers))

    # h2d, layer by layer, into other device pages (page 5 is reused in another position)
    load_locs = pages_to_locs([1, 4, 6, 5], page_size)
    device_before = device_snapshot(device_pool)
    load_stream = sim.Stream()
    with sim.stream(load_stream):
        for layer in layers:
            host_pool.load_to_device_per_layer(
                device_pool, host_slots, load_locs, layer, io_backend
            )
    assert_same(device_snapshot(device_pool), device_before)
    for layer in layers:
        sim.advance(load_stream, 1)
        landed = [layer_id for layer_id in layers if layer_id <= layer]
        assert_same(
            device_snapshot(device_pool), scatter(device_before, load_locs, written, landed)
        )


@pytest.mark.parametrize(("io_backend", "layout"), LEGAL_PAIRS)
def test_per_layer_backup_moves_only_that_layer(io_backend: str, layout: str) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_pools(kind_for(layout), sim, layout=layout)
    fill_with_sentinel(device_pool, host_pool)
    device_locs = pages_to_locs([3, 1], 4)
    host_slots = pages_to_locs([0, 5], 4)
    fill_device_rows(device_pool, device_locs, seed=2)
    host_before = host_snapshot(host_pool)
    host_pool.backup_from_device_per_layer(device_pool, host_slots, device_locs, 1, io_backend)
    sim.run_until_idle()
    written = {
        (c, 1): row_values(device_pool, c, 1, device_locs, seed=2)
        for c in device_pool.component_names()
    }
    assert_same(host_snapshot(host_pool), scatter(host_before, host_slots, written, [1]))


def test_copy_reads_the_device_bytes_when_the_stream_runs_not_at_launch() -> None:
    # launch d2h -> the forward overwrites the rows (no ordering) -> run: the host gets the new bytes
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim)
    device_locs = pages_to_locs([2], 4)
    host_slots = pages_to_locs([0], 4)
    fill_device_rows(device_pool, device_locs, seed=1)
    host_pool.backup_from_device_all_layer(device_pool, host_slots, device_locs, "direct")
    fill_device_rows(device_pool, device_locs, seed=2)
    sim.run_until_idle()
    assert torch.equal(
        host_pool.read_rows("k", 0, host_slots), row_values(device_pool, "k", 0, device_locs, 2)
    )


def test_d2h_without_waiting_for_the_store_copies_stale_bytes() -> None:
    # the store of layer 0 is queued on the forward stream; a d2h on the write stream that does
    # not wait for it copies the old bytes (the bug INV-12 forbids); with the wait it copies the new
    sim = SimDevice()
    device_pool, host_pool = make_pools("mla", sim)
    device_locs = pages_to_locs([4], 4)
    host_slots = pages_to_locs([1], 4)
    new_rows = row_values(device_pool, "kv", 0, device_locs, seed=9)

    def store() -> None:
        device_pool.write_rows("kv", 0, device_locs, new_rows)

    for wait in (False, True):
        fill_with_sentinel(device_pool, host_pool)
        forward, write_stream = sim.Stream(), sim.Stream()
        with sim.stream(forward):
            sim.launch(store, label="store layer 0", kind="kernel")
            stored = sim.Event()
            stored.record()
        with sim.stream(write_stream):
            if wait:
                stored.wait()
            host_pool.backup_from_device_per_layer(
                device_pool, host_slots, device_locs, 0, "direct"
            )
        sim.advance(write_stream, 2)
        sim.run_until_idle()
        landed = host_pool.read_rows("kv", 0, host_slots)
        assert torch.equal(landed, new_rows) is wait


def test_launch_records_what_it_copies_in_the_sim_log() -> None:
    sim = SimDevice()
    device_pool, host_pool = make_pools("nsa", sim, layout="page_first")
    host_pool.load_to_device_per_layer(
        device_pool, pages_to_locs([2], 4), pages_to_locs([3], 4), 2, "kernel"
    )
    sim.run_until_idle()
    (entry,) = sim.log
    assert entry.kind == "copy" and entry.label == "h2d layer 2"
    assert entry.meta["direction"] == "h2d" and entry.meta["layer_ids"] == (2,)
    assert entry.meta["components"] == ("kv", "index_k")
    host_indices = entry.meta["host_indices"]
    assert isinstance(host_indices, torch.Tensor) and host_indices.tolist() == list(range(8, 12))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(
        [
            ("direct", "layer_first"),
            ("kernel", "layer_first"),
            ("kernel", "page_first"),
            ("kernel", "page_head"),
        ]
    ),
    st.permutations(list(range(24))),
    st.permutations(list(range(4, 36))),
    st.integers(min_value=0, max_value=24),
)
def test_gather_and_run_paths_agree_on_any_token_pairs(
    backend_layout: tuple[str, str], host_order: list[int], device_order: list[int], count: int
) -> None:
    io_backend, layout = backend_layout
    host_slots = torch.tensor(host_order[:count], dtype=torch.int64)
    device_locs = torch.tensor(device_order[:count], dtype=torch.int64)
    results = []
    for copy_path in ("gather", "runs"):
        sim = SimDevice()
        device_pool, host_pool = make_pools(
            "mha", sim, layout=layout, copy_path=copy_path, host_size=24
        )
        fill_with_sentinel(device_pool, host_pool)
        fill_device_rows(device_pool, torch.arange(36), seed=3)
        host_pool.backup_from_device_all_layer(device_pool, host_slots, device_locs, io_backend)
        sim.run_until_idle()
        results.append(host_snapshot(host_pool))
        # reference: dst[dst_idx[i]] = src[src_idx[i]], one token at a time
        for (component, layer), rows in results[-1].items():
            for h, d in zip(host_slots.tolist(), device_locs.tolist(), strict=True):
                assert torch.equal(
                    rows[h], row_values(device_pool, component, layer, torch.tensor([d]), 3)[0]
                )
    assert_same(results[0], results[1])


# ---------------------------------------------------------------------- refused at launch


@pytest.fixture(params=WHOLE_PAGE_LAYOUTS)
def pools(request: pytest.FixtureRequest) -> tuple[SimDevice, KVCache, HostKVCache]:
    """An MHA pool pair under a layout the direct backend moves page by page."""
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout=request.param)
    return sim, device_pool, host_pool


@pytest.mark.parametrize(("io_backend", "layout"), ILLEGAL_PAIRS)
def test_unsupported_layout_backend_pairs_are_refused(io_backend: str, layout: str) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout=layout)
    locs = pages_to_locs([1], 4)
    message = (
        f"io_backend '{io_backend}' cannot drive host layout '{layout}'; legal pairs: "
        f"{LEGAL_PAIRS_TEXT}$"
    )
    with pytest.raises(HiCacheInputError, match=message):
        host_pool.backup_from_device_all_layer(device_pool, locs, locs, io_backend)
    with pytest.raises(HiCacheInputError, match=message):
        host_pool.backup_from_device_per_layer(device_pool, locs, locs, 0, io_backend)
    with pytest.raises(HiCacheInputError, match=message):
        host_pool.load_to_device_per_layer(device_pool, locs, locs, 0, io_backend)
    assert sim.pending_ops() == 0


def test_illegal_pairs_are_exactly_the_four_upstream_and_the_fork_lack() -> None:
    assert ILLEGAL_PAIRS == [
        ("direct", "page_first"),
        ("direct", "page_head"),
        ("kernel", "page_first_direct"),
        ("kernel", "layer_page_first"),
    ]


def test_unknown_io_backend_is_refused(pools: tuple[SimDevice, KVCache, HostKVCache]) -> None:
    sim, device_pool, host_pool = pools
    locs = pages_to_locs([1], 4)
    with pytest.raises(
        UnknownOptionError, match="unknown io_backend 'kernel_ascend'; legal values: direct, kernel"
    ):
        host_pool.load_to_device_per_layer(device_pool, locs, locs, 0, "kernel_ascend")
    assert sim.pending_ops() == 0


def test_layer_out_of_range_is_refused(pools: tuple[SimDevice, KVCache, HostKVCache]) -> None:
    sim, device_pool, host_pool = pools
    locs = pages_to_locs([1], 4)
    with pytest.raises(LayerRangeError, match=r"layer_id 3 is outside \[0, layer_num\) = \[0, 3\)"):
        host_pool.load_to_device_per_layer(device_pool, locs, locs, 3, "direct")
    with pytest.raises(LayerRangeError):
        host_pool.backup_from_device_per_layer(device_pool, locs, locs, -1, "direct")
    assert sim.pending_ops() == 0


def test_a_layer_past_its_pool_is_a_byte_equality_failure_under_a_gate() -> None:
    # a side pool's load mapped with the anchor's layers names layer 3 of a 3-layer pool: a
    # gate names the rule (INV-06: the layer's bytes land nowhere), a caller still catches it
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout="layer_first")
    locs = pages_to_locs([1], 4)
    with pytest.raises(LayerOutsidePoolError, match=r"^INV-06: a transfer addressed layer_id 3"):
        host_pool.load_to_device_per_layer(device_pool, locs, locs, 3, "direct")
    with pytest.raises(LayerOutsidePoolError) as caught:
        host_pool.backup_from_device_per_layer(device_pool, locs, locs, -1, "direct")
    assert isinstance(caught.value, LayerRangeError)
    assert get_failure_invariant(caught.value) == "INV-06"
    assert sim.pending_ops() == 0


@pytest.mark.parametrize(
    ("host", "device", "message"),
    [
        ([0, 1, 2, 3], [4, 5, 6], "host_indices has 4 entries but device_indices has 3"),
        (
            [0, 1, 2, 3],
            [-4, 5, 6, 7],
            r"device_indices\[0\]=-4 is negative; sgl-kernel silently skips",
        ),
        (
            [0, 1, 2, 3],
            [36, 37, 38, 39],
            r"device_indices\[0\]=36 is outside its pool's rows \[0, 36\)",
        ),
        (
            [64, 65, 66, 67],
            [4, 5, 6, 7],
            r"host_indices\[0\]=64 is outside its pool's rows \[0, 64\)",
        ),
        ([0, 1, 0, 1], [4, 5, 6, 7], r"host_indices \(the d2h destination\) repeats a row"),
    ],
)
def test_bad_index_pairs_are_refused(host: list[int], device: list[int], message: str) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout="layer_first")
    with pytest.raises(HiCacheInputError, match=message):
        host_pool.backup_from_device_all_layer(
            device_pool, torch.tensor(host), torch.tensor(device), "kernel"
        )
    assert sim.pending_ops() == 0


def test_an_index_past_its_pool_is_a_slot_conservation_failure_under_a_gate() -> None:
    # the controller under test built these indices: a gate names the rule it broke (INV-05),
    # not "bad input", while a direct caller still catches a HiCacheInputError
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout="layer_first")
    with pytest.raises(IndexOutsidePoolError, match=r"^INV-05: host_indices\[0\]=64") as caught:
        host_pool.backup_from_device_all_layer(
            device_pool, torch.tensor([64, 65, 66, 67]), torch.tensor([4, 5, 6, 7]), "kernel"
        )
    assert isinstance(caught.value, HiCacheInputError)
    assert get_failure_invariant(caught.value) == "INV-05"
    assert sim.pending_ops() == 0


def test_whole_page_layouts_need_one_aligned_host_page_per_chunk(
    pools: tuple[SimDevice, KVCache, HostKVCache],
) -> None:
    sim, device_pool, host_pool = pools
    with pytest.raises(
        PageAlignmentError,
        match=r"INV-01: host_indices chunk 0 .*\[2, 3, 4, 5\].*page 0 = \[0\.\.3\]",
    ):
        host_pool.backup_from_device_all_layer(
            device_pool, torch.tensor([2, 3, 4, 5]), pages_to_locs([1], 4), "direct"
        )
    with pytest.raises(PageAlignmentError, match="INV-01: host_indices has 2 token locations"):
        host_pool.backup_from_device_all_layer(
            device_pool, torch.tensor([0, 1]), torch.tensor([4, 5]), "direct"
        )
    assert sim.pending_ops() == 0


def test_whole_page_layouts_need_contiguous_device_chunks(
    pools: tuple[SimDevice, KVCache, HostKVCache],
) -> None:
    sim, device_pool, host_pool = pools
    with pytest.raises(
        PageAlignmentError, match=r"INV-01: device_indices chunk 1 holds \[8, 9, 11, 10\]"
    ):
        host_pool.load_to_device_per_layer(
            device_pool,
            pages_to_locs([0, 1], 4),
            torch.tensor([4, 5, 6, 7, 8, 9, 11, 10]),
            0,
            "direct",
        )
    assert sim.pending_ops() == 0


@pytest.mark.parametrize("layout", WHOLE_PAGE_LAYOUTS)
def test_whole_page_layouts_accept_an_unaligned_contiguous_device_run(layout: str) -> None:
    # upstream's direct pf path takes the device side as a contiguous run from its first index
    sim = SimDevice()
    device_pool, host_pool = make_pools("mha", sim, layout=layout)
    device_locs = torch.arange(6, 10)
    fill_device_rows(device_pool, device_locs, seed=5)
    host_pool.backup_from_device_all_layer(
        device_pool, pages_to_locs([3], 4), device_locs, "direct"
    )
    sim.run_until_idle()
    assert torch.equal(
        host_pool.read_rows("v", 2, pages_to_locs([3], 4)),
        row_values(device_pool, "v", 2, device_locs, 5),
    )


def test_a_device_pool_of_another_geometry_is_refused() -> None:
    sim = SimDevice()
    _, host_pool = make_pools("mha", sim)
    other = make_device_pool("mla", sim)
    locs = pages_to_locs([1], 4)
    with pytest.raises(HiCacheInputError, match="does not match this host pool"):
        host_pool.backup_from_device_all_layer(other, locs, locs, "direct")
    assert sim.pending_ops() == 0


def test_unknown_copy_path_is_refused() -> None:
    with pytest.raises(
        UnknownOptionError, match="unknown copy_path 'fast'; legal values: auto, gather, runs"
    ):
        make_pools("mha", SimDevice(), copy_path="fast")


def test_sentinel_is_distinct_from_written_rows() -> None:
    pool = make_device_pool("mha", SimDevice())
    assert not bool((row_values(pool, "k", 0, torch.arange(36), 1) == SENTINEL).any())
