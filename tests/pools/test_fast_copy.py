"""The fast copy paths against the reference gather path, byte for byte, on SimDevice.

``batch`` plans pointer arrays (``copy_plan``) and executes them with one ``memmove`` per copy
when the stream runs; ``triton`` runs the zero-copy kernel under Triton's interpreter (skipped
when Triton is not installed). Two worlds start from the same random bytes, one transfer runs in
each (gather in one, the fast path in the other), and every byte of every host and device
buffer must then agree: moved rows and untouched rows alike. Bad index pairs are refused with
the reference's errors, nothing queued; ``page_head`` is refused by ``batch`` with the legal
paths named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, InvariantViolation, PageAlignmentError
from hicache_ref.pools import (
    HostKVCache,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
    make_host_pool,
)
from hicache_ref.pools.copy_engine import CopyEngineError, CudaBatchCopier, memmove_copies
from hicache_ref.pools.copy_plan import (
    PlanCache,
    check_copies_in_bounds,
    compute_host_row_geometry,
    plan_component_copies,
    plan_row_runs,
)
from hicache_ref.pools.host_layout import compute_host_buffer_shape, host_row_index
from hicache_ref.pools.transfer import PLAN_CACHE, copy_paths_for_layout
from hicache_ref.pools.triton_copy import (
    TritonLaunch,
    TritonTile,
    _int_widths,
    component_deltas,
    compute_vector_words,
    is_triton_available,
)

from .builders import ALL_LAYOUTS, pages_to_locs
from .test_host_transfers import LEGAL_CASES

NEEDS_TRITON = pytest.mark.skipif(
    not is_triton_available(), reason="needs the triton package (its CPU interpreter)"
)
WHOLE_PAGE = ("page_first_direct", "layer_page_first")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def copy_paths_batch_layouts() -> tuple[str, ...]:
    return tuple(layout for layout in ALL_LAYOUTS if "batch" in copy_paths_for_layout(layout))  # type: ignore[arg-type]


FAST_CASES = [
    (path, io_backend, layout, kind)
    for path in ("batch", "triton")
    for io_backend, layout, kind in LEGAL_CASES
    if path == "triton" or layout in copy_paths_batch_layouts()
]


def make_typed_pools(
    kind: str,
    sim: SimDevice,
    *,
    dtype: torch.dtype,
    layout: str,
    page_size: int,
    copy_path: str,
    device_pages: int,
    host_pages: int,
    layer_num: int,
) -> tuple[KVCache, HostKVCache]:
    """A device pool of ``kind`` and its host pool, rows of a few elements of ``dtype``."""
    size = device_pages * page_size
    pool: KVCache
    if kind == "mha":
        pool = MHATokenToKVPool(size, page_size, dtype, 2, 3, layer_num, sim)
    elif kind == "mla":
        pool = MLATokenToKVPool(size, page_size, dtype, 3, 2, layer_num, sim)
    else:
        pool = NSATokenToKVPool(size, page_size, dtype, 3, 2, layer_num, sim, index_head_dim=4)
    host = make_host_pool(
        pool, layout=layout, size_tokens=host_pages * page_size, copy_path=copy_path
    )
    return pool, host


def all_buffers(device_pool: KVCache, host_pool: HostKVCache) -> list[torch.Tensor]:
    buffers = list(host_pool.buffers.values())
    for name in device_pool.component_names():
        buffers += [
            device_pool.component_buffer(name, layer) for layer in range(device_pool.layer_num)
        ]
    return buffers


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def fill_random_bytes(device_pool: KVCache, host_pool: HostKVCache, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for buffer in all_buffers(device_pool, host_pool):
        raw = as_bytes(buffer)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def assert_same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for index, (left, right) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(as_bytes(left), as_bytes(right)), f"buffer {index} differs"


@st.composite
def transfers(draw: st.DrawFn, *, paths: tuple[str, ...]) -> dict[str, Any]:
    """A legal (path, backend, layout, kind) with random index pairs that pass INV-01."""
    path, io_backend, layout, kind = draw(
        st.sampled_from([case for case in FAST_CASES if case[0] in paths])
    )
    page_size = draw(st.sampled_from([1, 2, 4]))
    direction = draw(st.sampled_from(["d2h", "h2d"]))
    device_pages, host_pages = 6, 6
    device_rows = (device_pages + 1) * page_size  # the padding page is addressable too
    if io_backend == "direct" and layout in WHOLE_PAGE:
        host_page_list = draw(
            st.lists(st.integers(0, host_pages - 1), min_size=0, max_size=4, unique=True)
        )
        offset = draw(st.integers(0, page_size - 1))
        starts = draw(
            st.lists(
                st.integers(0, device_pages - 1),
                min_size=len(host_page_list),
                max_size=len(host_page_list),
                unique=True,
            )
        )
        host = pages_to_locs(host_page_list, page_size)
        device = torch.tensor(
            [s * page_size + offset + i for s in starts for i in range(page_size)],
            dtype=torch.int64,
        )
    else:
        n = draw(st.integers(0, 3 * page_size + 3))
        destination_rows = host_pages * page_size if direction == "d2h" else device_rows
        source_rows = device_rows if direction == "d2h" else host_pages * page_size
        # runs of consecutive rows make the planner merge; a permutation breaks them
        destination = draw(
            st.lists(st.integers(0, destination_rows - 1), min_size=n, max_size=n, unique=True)
        )
        if draw(st.booleans()):
            destination = sorted(destination)
        source_start = draw(st.integers(0, max(0, source_rows - n)))
        source = draw(
            st.one_of(
                st.just([min(source_start + i, source_rows - 1) for i in range(n)]),
                st.lists(st.integers(0, source_rows - 1), min_size=n, max_size=n),
            )
        )
        host_list, device_list = (
            (destination, source) if direction == "d2h" else (source, destination)
        )
        host = torch.tensor(host_list, dtype=torch.int64)
        device = torch.tensor(device_list, dtype=torch.int64)
    return {
        "path": path,
        "io_backend": io_backend,
        "layout": layout,
        "kind": kind,
        "page_size": page_size,
        "direction": direction,
        "dtype": draw(st.sampled_from(DTYPES)),
        "layer_num": draw(st.integers(1, 3)),
        "per_layer": draw(st.booleans()),
        "host": host,
        "device": device,
        "index_dtype": draw(st.sampled_from([torch.int64, torch.int32])),
        "seed": draw(st.integers(0, 2**16)),
        "device_pages": device_pages,
        "host_pages": host_pages,
    }


def run_transfer(
    case: dict[str, Any], copy_path: str, triton: TritonLaunch | None = None
) -> list[torch.Tensor]:
    """Build a world, fill it with the case's random bytes, run the transfer, return buffers."""
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        case["kind"],
        sim,
        dtype=case["dtype"],
        layout=case["layout"],
        page_size=case["page_size"],
        copy_path=copy_path,
        device_pages=case["device_pages"],
        host_pages=case["host_pages"],
        layer_num=case["layer_num"],
    )
    fill_random_bytes(device_pool, host_pool, case["seed"])
    if triton is not None:
        host_pool.triton_launch = triton
    host = case["host"].to(case["index_dtype"])
    device = case["device"].to(case["index_dtype"])
    layers = range(device_pool.layer_num)
    if case["direction"] == "d2h" and not case["per_layer"]:
        host_pool.backup_from_device_all_layer(device_pool, host, device, case["io_backend"])
    elif case["direction"] == "d2h":
        for layer in layers:
            host_pool.backup_from_device_per_layer(
                device_pool, host, device, layer, case["io_backend"]
            )
    else:
        for layer in layers:
            host_pool.load_to_device_per_layer(device_pool, host, device, layer, case["io_backend"])
    sim.run_until_idle()
    return all_buffers(device_pool, host_pool)


@given(case=transfers(paths=("batch",)))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_batch_path_moves_exactly_the_bytes_of_the_gather_path(case: dict[str, Any]) -> None:
    # same random bytes in two worlds -> same transfer via gather and via batch -> same bytes
    assert_same_bytes(run_transfer(case, "batch"), run_transfer(case, "gather"))


@NEEDS_TRITON
@given(
    case=transfers(paths=("triton",)),
    grid=st.sampled_from([1, 3, 8]),
    rows=st.sampled_from([1, 2, 16]),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_triton_kernel_moves_exactly_the_bytes_of_the_gather_path(
    case: dict[str, Any], grid: int, rows: int
) -> None:
    # tiles of 1, 2 or 16 pairs: a last partial tile and several tiles per program included
    fast = run_transfer(case, "triton", TritonLaunch(grid, TritonTile(rows, warps=4)))
    assert_same_bytes(fast, run_transfer(case, "gather"))


def fixed_case(
    path: str, io_backend: str, layout: str, kind: str, page_size: int, direction: str
) -> dict[str, Any]:
    """Unordered pages on both sides, an unaligned device run, every layer and a bf16 pool."""
    host = pages_to_locs([3, 0, 5], page_size)
    if io_backend == "direct" and layout in WHOLE_PAGE:
        device = torch.cat(
            [torch.arange(4, 4 + page_size) + page * page_size for page in (1, 0, 3)]
        )
        device = device if page_size > 1 else pages_to_locs([2, 0, 4], 1)
    else:
        device = torch.randperm(6 * page_size, generator=torch.Generator().manual_seed(3))[
            : 3 * page_size
        ]
    return {
        "path": path, "io_backend": io_backend, "layout": layout, "kind": kind,
        "page_size": page_size, "direction": direction, "dtype": torch.bfloat16,
        "layer_num": 3, "per_layer": direction == "d2h" and page_size == 1, "host": host,
        "device": device, "index_dtype": torch.int64, "seed": 5, "device_pages": 6,
        "host_pages": 6,
    }  # fmt: skip


FIXED_CASES = [
    pytest.param(
        fixed_case(path, io_backend, layout, kind, page_size, direction),
        id=f"{path}-{io_backend}-{layout}-{kind}-p{page_size}-{direction}",
        marks=[NEEDS_TRITON] if path == "triton" else [],
    )
    for path, io_backend, layout, kind in FAST_CASES
    # the interpreted kernel is slow: one pool kind per layout (NSA, or MHA for page_head)
    if path == "batch" or kind == ("mha" if layout == "page_head" else "nsa")
    for page_size in ((1, 4) if path == "batch" else (4,))
    for direction in ("d2h", "h2d")
]


@pytest.mark.parametrize("case", FIXED_CASES)
def test_every_legal_case_moves_the_bytes_of_the_gather_path(case: dict[str, Any]) -> None:
    # one transfer per world: the fast path here, gather there -> every buffer byte-equal
    assert_same_bytes(run_transfer(case, case["path"]), run_transfer(case, "gather"))


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_host_row_geometry_addresses_the_rows_of_host_row_index(layout: str) -> None:
    size, layer_num, page_size, row_shape = 12, 3, 4, (2, 3)
    shape = compute_host_buffer_shape(layout, size, layer_num, page_size, row_shape)  # type: ignore[arg-type]
    buffer = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)
    geometry = compute_host_row_geometry(layout, size, layer_num, page_size, row_shape)  # type: ignore[arg-type]
    slots = torch.arange(size)
    flat = buffer.view(-1)
    for layer in range(layer_num):
        rows = buffer[host_row_index(layout, layer, slots, page_size)].reshape(size, -1)  # type: ignore[arg-type]
        bases = layer * geometry.layer_stride + geometry.slot_offsets(slots)
        for slot in range(size):
            pieces = [
                flat[start : start + geometry.piece_numel]
                for start in (
                    int(bases[slot]) + j * geometry.piece_stride for j in range(geometry.piece_num)
                )
            ]
            assert torch.equal(torch.cat(pieces), rows[slot]), (layout, layer, slot)


@pytest.mark.parametrize(
    ("layout", "runs"),
    [
        ("layer_first", 1),  # slots 0..7 are adjacent in one layer, across the page boundary
        ("layer_page_first", 1),  # likewise: a layer's pages follow each other
        ("page_first_direct", 2),  # a layer's rows are adjacent only inside one host page
        ("page_first", 8),  # the layers of a slot sit between two slots: one copy per row
    ],
)
def test_runs_merge_exactly_where_memory_is_contiguous(layout: str, runs: int) -> None:
    geometry = compute_host_row_geometry(layout, 16, 3, 4, (1, 5))  # type: ignore[arg-type]
    plan = plan_row_runs(geometry, torch.arange(8), torch.arange(20, 28))
    assert plan.lengths.numel() == runs
    assert int(plan.lengths.sum()) == 8


@settings(max_examples=80, deadline=None)
@given(
    layout=st.sampled_from(["layer_first", "page_first", "page_first_direct", "layer_page_first"]),
    pairs=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 47)), max_size=40),
)
def test_runs_expand_back_to_exactly_the_pairs_in_order(
    layout: str, pairs: list[tuple[int, int]]
) -> None:
    """The planner's runs (numpy, on the caller's thread) cover each pair once and in order: row
    ``j`` of a run is the next pair's host row and device loc."""
    geometry = compute_host_row_geometry(layout, 32, 3, 4, (1, 5))  # type: ignore[arg-type]
    host = torch.tensor([h for h, _ in pairs], dtype=torch.int64)
    device = torch.tensor([d for _, d in pairs], dtype=torch.int64)
    plan = plan_row_runs(geometry, host, device)
    expanded = [
        (first_host + j, first_device + j)
        for first_host, first_device, length in zip(
            plan.host_rows.tolist(), plan.device_rows.tolist(), plan.lengths.tolist(), strict=True
        )
        for j in range(length)
    ]
    row = geometry.piece_numel
    rows = [int(geometry.slot_offsets(torch.tensor([h]))[0]) // row for h, _ in pairs]
    assert expanded == list(zip(rows, [d for _, d in pairs], strict=True))
    assert all(length >= 1 for length in plan.lengths.tolist())


def test_a_plan_reaching_past_its_buffer_is_refused_before_any_copy() -> None:
    geometry = compute_host_row_geometry("layer_first", 8, 2, 4, (1, 2))
    runs = plan_row_runs(geometry, torch.tensor([6, 7]), torch.tensor([0, 1]))
    copies = plan_component_copies("kv", runs, geometry, 4)
    host_buffer = torch.zeros(2, 8, 1, 2)
    check_copies_in_bounds(copies, host_buffer=host_buffer, device_buffer_nbytes=16, layer_id=1)
    with pytest.raises(InvariantViolation, match=r"INV-06 violated: a copy plan of component 'kv'"):
        check_copies_in_bounds(
            copies, host_buffer=host_buffer[:1], device_buffer_nbytes=16, layer_id=1
        )


def test_memmove_executor_copies_each_entry() -> None:
    source = torch.arange(8, dtype=torch.uint8)
    target = torch.zeros(8, dtype=torch.uint8)
    dsts = torch.tensor([target.data_ptr() + 4, target.data_ptr()])
    srcs = torch.tensor([source.data_ptr(), source.data_ptr() + 6])
    memmove_copies(dsts, srcs, torch.tensor([3, 2]))
    assert target.tolist() == [6, 7, 0, 0, 0, 1, 2, 0]


@pytest.mark.parametrize(
    ("layout", "kind", "why"),
    [("page_head", "mha", "one head_dim piece per head"), ("page_first", "mla", "interleave")],
)
def test_batch_refuses_fragmented_layouts_naming_the_legal_paths(
    layout: str, kind: str, why: str
) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        kind, sim, dtype=torch.float32, layout=layout, page_size=4, copy_path="batch",
        device_pages=4, host_pages=4, layer_num=2,
    )  # fmt: skip
    locs = pages_to_locs([1], 4)
    with pytest.raises(
        HiCacheInputError,
        match=rf"copy_path='batch' cannot drive host layout '{layout}': .*{why}.*legal copy "
        r"paths for it: auto, gather, runs, triton$",
    ):
        host_pool.load_to_device_per_layer(device_pool, locs, locs, 0, "kernel")
    assert sim.pending_ops() == 0
    assert "batch" in copy_paths_for_layout("layer_page_first")


BAD_PAIRS = [
    ([0, 1, 2, 3], [0, 1, 2], "host_indices has 4 entries but device_indices has 3"),
    ([0, -1, 2, 3], [0, 1, 2, 3], r"host_indices\[1\]=-1 is negative"),
    ([0, 1, 2, 3], [0, 1, 2, 99], r"device_indices\[3\]=99 is outside its pool's rows"),
    ([0, 1, 2, 3], [0, 1, 1, 3], r"device_indices \(the h2d destination\) repeats a row"),
]


@pytest.mark.parametrize(("host", "device", "message"), BAD_PAIRS)
@pytest.mark.parametrize("path", ["batch", pytest.param("triton", marks=NEEDS_TRITON)])
def test_bad_index_pairs_are_refused_with_the_reference_errors(
    path: str, host: list[int], device: list[int], message: str
) -> None:
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        "nsa", sim, dtype=torch.float32, layout="layer_first", page_size=4, copy_path=path,
        device_pages=4, host_pages=4, layer_num=2,
    )  # fmt: skip
    with pytest.raises(HiCacheInputError, match=message):
        host_pool.load_to_device_per_layer(
            device_pool, torch.tensor(host), torch.tensor(device), 0, "kernel"
        )
    assert sim.pending_ops() == 0


def test_whole_page_layouts_keep_their_chunk_checks_under_batch() -> None:
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        "mla", sim, dtype=torch.float32, layout="page_first_direct", page_size=4,
        copy_path="batch", device_pages=4, host_pages=4, layer_num=2,
    )  # fmt: skip
    with pytest.raises(PageAlignmentError, match=r"INV-01: device_indices chunk 1 holds"):
        host_pool.load_to_device_per_layer(
            device_pool, pages_to_locs([0, 1], 4), torch.tensor([0, 1, 2, 3, 8, 9, 11, 10]), 0,
            "direct",
        )  # fmt: skip


def test_per_layer_loads_plan_once_and_an_in_place_change_replans() -> None:
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        "mla", sim, dtype=torch.float32, layout="layer_first", page_size=4, copy_path="batch",
        device_pages=4, host_pages=4, layer_num=3,
    )  # fmt: skip
    host, device = pages_to_locs([2, 0], 4), pages_to_locs([1, 3], 4)
    PLAN_CACHE.clear()
    misses, hits = PLAN_CACHE.misses, PLAN_CACHE.hits
    prepared = host_pool.layer_launches.prepared_pairs
    # three per-layer loads with the same tensors -> one plan, prepared once; layers 1 and 2
    # are the host pool's prepared pair (not even a plan lookup)
    for layer in range(3):
        host_pool.load_to_device_per_layer(device_pool, host, device, layer, "kernel")
    assert (PLAN_CACHE.misses - misses, PLAN_CACHE.hits - hits) == (1, 0)
    assert host_pool.layer_launches.prepared_pairs - prepared == 1
    # the caller rewrites an index in place -> the cache misses and the new value is checked
    device[0] = -5
    with pytest.raises(HiCacheInputError, match=r"device_indices\[0\]=-5 is negative"):
        host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    sim.run_until_idle()


def test_the_plan_cache_is_bounded_and_keeps_the_newest_plans() -> None:
    cache = PlanCache(entries_max=2)
    pairs = [(torch.arange(4), torch.arange(4)) for _ in range(3)]
    for number, (host, device) in enumerate(pairs):
        cache.put(host, device, "key", number)
    # the oldest pair fell out; the other two hit; another key misses
    assert [cache.get(h, d, "key") for h, d in pairs] == [None, 1, 2]
    assert cache.get(*pairs[2], "other key") is None


def test_batch_reads_the_device_bytes_when_the_stream_runs_not_at_launch() -> None:
    sim = SimDevice()
    device_pool, host_pool = make_typed_pools(
        "mla", sim, dtype=torch.float32, layout="layer_first", page_size=4, copy_path="batch",
        device_pages=4, host_pages=4, layer_num=1,
    )  # fmt: skip
    locs = pages_to_locs([1], 4)
    device_pool.component_buffer("kv", 0)[locs] = 1.0
    host_pool.backup_from_device_all_layer(device_pool, locs, locs, "kernel")
    device_pool.component_buffer("kv", 0)[locs] = 2.0  # written after launch, before the run
    assert host_pool.read_rows("kv", 0, locs).eq(0).all()
    sim.run_until_idle()
    assert host_pool.read_rows("kv", 0, locs).eq(2.0).all()


class _FakeRuntime:
    """A stand-in for libcudart: records the batch call and answers ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple[Any, ...]] = []

        def batch(*args: Any) -> int:
            self.calls.append(args)
            return self.code

        def error_name(code: int) -> bytes:
            return b"cudaErrorInvalidValue"

        self.cudaMemcpyBatchAsync = batch
        self.cudaGetErrorName = error_name


@pytest.mark.parametrize(("version", "arguments"), [(12080, 9), (12090, 9), (13000, 8)])
def test_copy_engine_binding_passes_the_signature_of_the_runtime_version(
    version: int, arguments: int
) -> None:
    runtime = _FakeRuntime(0)
    copier = CudaBatchCopier(runtime, "fake", version)  # type: ignore[arg-type]
    arrays = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([8, 8])]
    copier.issue(*arrays, d2h=True, device_index=0, stream_handle=77)
    (call,) = runtime.calls
    assert len(call) == arguments and call[3] == 2 and call[6] == 1 and call[-1] == 77
    assert [call[0], call[1], call[2]] == [a.data_ptr() for a in arrays]
    attrs = copier.attributes(d2h=True, device_index=0)
    assert (attrs.srcAccessOrder, attrs.srcLocHint.type, attrs.dstLocHint.type) == (1, 1, 2)


def test_copy_engine_binding_raises_on_a_failed_call_and_refuses_the_default_stream() -> None:
    copier = CudaBatchCopier(_FakeRuntime(1), "fake", 13000)  # type: ignore[arg-type]
    arrays = [torch.tensor([1]), torch.tensor([3]), torch.tensor([8])]
    with pytest.raises(
        CopyEngineError, match=r"of 1 copies failed with CUDA error 1 \(cudaErrorInvalidValue\)"
    ):
        copier.issue(*arrays, d2h=False, device_index=0, stream_handle=5)
    with pytest.raises(HiCacheInputError, match="refuses the legacy default stream"):
        copier.issue(*arrays, d2h=False, device_index=0, stream_handle=0)
    with pytest.raises(CopyEngineError, match="needs CUDA runtime 12\\.8"):
        CudaBatchCopier(_FakeRuntime(0), "fake", 12060)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rows", "warps"), [(0, 4), (3, 4), (512, 4), (16, 0), (16, 6), (16, 64)])
def test_a_triton_tile_that_cannot_compile_is_refused_in_one_line(rows: int, warps: int) -> None:
    with pytest.raises(HiCacheInputError, match="power of two"):
        TritonTile(rows, warps)


@pytest.mark.parametrize("grid", [0, -3])
def test_a_triton_grid_without_programs_is_refused_in_one_line(grid: int) -> None:
    with pytest.raises(HiCacheInputError, match="triton grid must be >= 1 programs"):
        TritonLaunch(grid)


def test_the_vector_hint_is_given_only_where_every_stride_keeps_16_bytes() -> None:
    # MLA rows of 576 bf16 (1,152 B) keep 16-byte offsets; rows of 7 bf16 (14 B) do not
    mla = compute_host_row_geometry("layer_first", 64, 2, 16, (576,))
    odd = compute_host_row_geometry("layer_first", 64, 2, 16, (7,))
    assert compute_vector_words(mla, 2, 4) == 4
    assert compute_vector_words(odd, 2, 2) == 1


def test_k_and_v_share_one_launch_only_when_16_bytes_apart() -> None:
    storage = torch.zeros(64, dtype=torch.uint8)
    assert component_deltas([storage[:16]], 4) == 0  # one component: no delta
    assert component_deltas([storage[:16], storage[32:48]], 4) == 8  # 32 bytes: 8 words
    assert component_deltas([storage[:16], storage[36:52]], 4) is None  # not 16-byte apart
    assert component_deltas([storage[:8], storage[16:24], storage[32:40]], 4) is None


def test_a_compiled_runner_is_never_reused_past_its_integer_width() -> None:
    # Triton types an unspecialized int as i32 or i64 by value: the runner key says which
    assert _int_widths(0, 2**31 - 1, -(2**31)) == (True, True, True)
    assert _int_widths(2**31, -(2**31) - 1) == (False, False)
