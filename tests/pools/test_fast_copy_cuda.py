"""The fast copy paths on a real GPU: ``batch`` (``cudaMemcpyBatchAsync`` on the copy engine)
and ``triton`` (the zero-copy kernel) between pinned host pools and CUDA device pools, for every
legal (path, io_backend, layout, pool kind), byte-equal to the gather semantics computed on CPU
copies of the same buffers (moved rows and untouched rows). With CPU index tensors the issue
path must not synchronize the host; CUDA index tensors cost one host copy each per plan."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache_ref.device import CudaDevice, cuda_available
from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools import HostKVCache, KVCache, make_host_pool, transfer_checks
from hicache_ref.pools.copy_engine import load_cuda_batch_copier
from hicache_ref.pools.copy_issuer import CopyIssuer
from hicache_ref.pools.host_layout import host_row_index
from hicache_ref.pools.layer_records import LayerRecords
from hicache_ref.pools.transfer import PLAN_CACHE, copy_paths_for_layout
from hicache_ref.pools.triton_copy import (
    TRITON_GRID_DEFAULT,
    TritonLaunch,
    TritonTile,
    is_triton_available,
)

from .builders import make_device_pool, pages_to_locs
from .test_host_transfers import LEGAL_CASES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"),
]
NEEDS_TRITON = pytest.mark.skipif(not is_triton_available(), reason="needs the triton package")
WHOLE_PAGE = ("page_first_direct", "layer_page_first")
CASES = [
    pytest.param(
        path, io_backend, layout, kind,
        marks=[NEEDS_TRITON] if path == "triton" else [],
        id=f"{path}-{io_backend}-{layout}-{kind}",
    )
    for path in ("batch", "triton")
    for io_backend, layout, kind in LEGAL_CASES
    if path == "triton" or "batch" in copy_paths_for_layout(layout)  # type: ignore[arg-type]
]  # fmt: skip


@pytest.fixture
def cuda() -> Iterator[CudaDevice]:
    device = CudaDevice()
    yield device
    device.synchronize()


def gpu_pools(
    cuda: CudaDevice, kind: str, layout: str, page_size: int, copy_path: str
) -> tuple[KVCache, HostKVCache]:
    device_pool = make_device_pool(kind, cuda, size=8 * page_size, page_size=page_size)
    host_pool = make_host_pool(
        device_pool, layout=layout, size_tokens=8 * page_size, copy_path=copy_path
    )
    assert all(buffer.is_pinned() for buffer in host_pool.buffers.values())
    generator = torch.Generator().manual_seed(page_size)
    for name in device_pool.component_names():
        for layer in range(device_pool.layer_num):
            buffer = device_pool.component_buffer(name, layer)
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        host_pool.buffers[name].copy_(
            torch.randn(host_pool.buffers[name].shape, generator=generator)
        )
    return device_pool, host_pool


def snapshot(
    device_pool: KVCache, host_pool: HostKVCache
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], torch.Tensor]]:
    host = {name: buffer.clone() for name, buffer in host_pool.buffers.items()}
    device = {
        (name, layer): device_pool.component_buffer(name, layer).cpu()
        for name in device_pool.component_names()
        for layer in range(device_pool.layer_num)
    }
    return host, device


def apply_gather(
    state: tuple[dict[str, torch.Tensor], dict[tuple[str, int], torch.Tensor]],
    *,
    direction: str,
    layout: str,
    page_size: int,
    host: torch.Tensor,
    device: torch.Tensor,
) -> None:
    """The reference semantics, on CPU copies: ``dst[dst_indices[i]] = src[src_indices[i]]``."""
    host_buffers, device_buffers = state
    for (name, layer), device_buffer in device_buffers.items():
        key = host_row_index(layout, layer, host, page_size)  # type: ignore[arg-type]
        if direction == "d2h":
            host_buffers[name][key] = device_buffer[device]
        else:
            device_buffer[device] = host_buffers[name][key]


def index_pairs(io_backend: str, layout: str, page_size: int) -> tuple[torch.Tensor, ...]:
    """Host slots, backup device locs and load device locs (unordered pages; an unaligned
    contiguous device run for the whole-page layouts)."""
    host = pages_to_locs([6, 1, 3, 2], page_size)
    if io_backend == "direct" and layout in WHOLE_PAGE and page_size > 1:
        shift = page_size // 2
        backup = torch.cat([torch.arange(page_size) + p * page_size + shift for p in (5, 2, 6, 0)])
        load = torch.cat([torch.arange(page_size) + p * page_size + shift for p in (1, 4, 3, 7)])
        return host, backup, load
    return host, pages_to_locs([5, 2, 7, 8], page_size), pages_to_locs([1, 4, 6, 5], page_size)


@pytest.mark.parametrize(("copy_path", "io_backend", "layout", "kind"), CASES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fast_path_round_trip_matches_the_gather_semantics(
    cuda: CudaDevice, copy_path: str, io_backend: str, layout: str, kind: str, page_size: int
) -> None:
    device_pool, host_pool = gpu_pools(cuda, kind, layout, page_size, copy_path)
    host, backup_locs, load_locs = index_pairs(io_backend, layout, page_size)
    expected = snapshot(device_pool, host_pool)
    # the kernel backend hands CUDA host indices (move_indices), the direct backend CPU ones
    host_arg = host.cuda() if io_backend == "kernel" else host
    write_stream, load_stream = cuda.Stream(), cuda.Stream()
    # backup every layer on a write stream -> host rows of the backup locs
    with cuda.stream(write_stream):
        host_pool.backup_from_device_all_layer(
            device_pool, host_arg, backup_locs.cuda(), io_backend
        )
    write_stream.synchronize()
    apply_gather(
        expected, direction="d2h", layout=layout, page_size=page_size, host=host,
        device=backup_locs,
    )  # fmt: skip
    # load layer by layer on a load stream into other device pages
    with cuda.stream(load_stream):
        for layer in range(device_pool.layer_num):
            host_pool.load_to_device_per_layer(
                device_pool, host_arg, load_locs.cuda(), layer, io_backend
            )
    load_stream.synchronize()
    apply_gather(
        expected, direction="h2d", layout=layout, page_size=page_size, host=host,
        device=load_locs,
    )  # fmt: skip
    actual = snapshot(device_pool, host_pool)
    for name, buffer in expected[0].items():
        assert torch.equal(actual[0][name], buffer), f"host buffer {name} differs"
    for key, buffer in expected[1].items():
        assert torch.equal(actual[1][key], buffer), f"device buffer {key} differs"


@pytest.mark.parametrize("copy_path", ["batch", pytest.param("triton", marks=NEEDS_TRITON)])
def test_issue_with_cpu_indices_does_not_sync_the_host(cuda: CudaDevice, copy_path: str) -> None:
    device_pool, host_pool = gpu_pools(cuda, "mla", "layer_first", 16, copy_path)
    host, backup_locs, load_locs = index_pairs("direct", "layer_first", 16)
    stream = cuda.Stream()
    with cuda.stream(stream):  # warm-up: load the runtime / compile the kernel
        host_pool.load_to_device_per_layer(device_pool, host, load_locs, 0, "direct")
    stream.synchronize()
    # the loads overwrite one backed-up page later in the same stream: keep the backed-up bytes
    backed_up = [
        device_pool.read_rows("kv", layer, backup_locs) for layer in range(device_pool.layer_num)
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with cuda.stream(stream):
            host_pool.backup_from_device_all_layer(device_pool, host, backup_locs, "direct")
            for layer in range(device_pool.layer_num):
                host_pool.load_to_device_per_layer(device_pool, host, load_locs, layer, "direct")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    for layer in range(device_pool.layer_num):
        assert torch.equal(host_pool.read_rows("kv", layer, host), backed_up[layer])
        assert torch.equal(device_pool.read_rows("kv", layer, load_locs), backed_up[layer])


def test_cuda_indices_cost_one_host_copy_each_per_plan(
    cuda: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    device_pool, host_pool = gpu_pools(cuda, "nsa", "layer_first", 4, "batch")
    host, _, load_locs = index_pairs("kernel", "layer_first", 4)
    host_arg, device_arg = host.cuda(), load_locs.cuda()
    PLAN_CACHE.clear()
    copied: list[torch.device] = []  # every index tensor the checks copy off the GPU
    on_cpu = transfer_checks.as_cpu_int64

    def counted(indices: torch.Tensor) -> torch.Tensor:
        if indices.device.type != "cpu":
            copied.append(indices.device)
        return on_cpu(indices)

    monkeypatch.setattr(transfer_checks, "as_cpu_int64", counted)
    with cuda.stream(cuda.Stream()):
        for layer in range(device_pool.layer_num):
            host_pool.load_to_device_per_layer(device_pool, host_arg, device_arg, layer, "kernel")
    # two CUDA index tensors -> two host copies for the first layer, none for the others
    assert len(copied) == 2
    cuda.synchronize()


def test_batch_on_the_legacy_default_stream_is_ordered_with_it(cuda: CudaDevice) -> None:
    copier = load_cuda_batch_copier()
    print(f"cudart: {copier.path} runtime {copier.runtime_version} threaded {copier.threaded}")
    device_pool, host_pool = gpu_pools(cuda, "mla", "layer_first", 4, "batch")
    host, backup_locs, _ = index_pairs("direct", "layer_first", 4)
    reroutes, threaded = copier.default_stream_reroutes, copier.threaded_batches
    assert torch.cuda.current_stream().cuda_stream == 0
    host_pool.backup_from_device_all_layer(device_pool, host, backup_locs, "direct")
    torch.cuda.current_stream().synchronize()  # the side stream's work is ordered before this
    # the issuing thread orders the default stream itself; inline issue reroutes each layer
    if copier.threaded:
        assert copier.threaded_batches - threaded == device_pool.layer_num
    else:
        assert copier.default_stream_reroutes - reroutes == device_pool.layer_num
    for layer in range(device_pool.layer_num):
        assert torch.equal(
            host_pool.read_rows("kv", layer, host), device_pool.read_rows("kv", layer, backup_locs)
        )


@NEEDS_TRITON
@pytest.mark.parametrize("grid", [1, 8, 132, 1000])
@pytest.mark.parametrize(("tile_rows", "warps"), [(1, 4), (16, 8), (64, 16)])
def test_triton_grid_sizes_all_move_every_row(
    cuda: CudaDevice, grid: int, tile_rows: int, warps: int
) -> None:
    device_pool, host_pool = gpu_pools(cuda, "mha", "page_head", 16, "triton")
    host, backup_locs, load_locs = index_pairs("kernel", "page_head", 16)
    layers, names = range(device_pool.layer_num), device_pool.component_names()
    backed_up = {
        (n, layer): device_pool.read_rows(n, layer, backup_locs) for n in names for layer in layers
    }
    host_pool.triton_launch = TritonLaunch(grid, TritonTile(tile_rows, warps))
    with cuda.stream(cuda.Stream()):
        host_pool.backup_from_device_all_layer(
            device_pool, host.cuda(), backup_locs.cuda(), "kernel"
        )
        for layer in layers:
            host_pool.load_to_device_per_layer(
                device_pool, host.cuda(), load_locs.cuda(), layer, "kernel"
            )
    cuda.synchronize()
    for (name, layer), rows in backed_up.items():
        assert torch.equal(host_pool.read_rows(name, layer, host), rows)
        assert torch.equal(device_pool.read_rows(name, layer, load_locs), rows)


@NEEDS_TRITON
def test_after_the_first_launch_the_compiled_kernel_is_called_directly(cuda: CudaDevice) -> None:
    # layer 0 goes through Triton's JIT and leaves a runner; every later layer (another base
    # offset, unspecialized) reuses it and still lands its own rows
    from hicache_ref.pools.triton_copy import _kernel

    runners_of = _kernel(False).runners
    runners_of.clear()
    device_pool, host_pool = gpu_pools(cuda, "mla", "layer_first", 16, "triton")
    host, backup_locs, load_locs = index_pairs("direct", "layer_first", 16)
    layers, names = range(device_pool.layer_num), device_pool.component_names()
    backed_up = {
        (n, layer): device_pool.read_rows(n, layer, backup_locs) for n in names for layer in layers
    }
    with cuda.stream(cuda.Stream()):
        host_pool.backup_from_device_all_layer(
            device_pool, host.cuda(), backup_locs.cuda(), "direct"
        )
        runners = len(runners_of)
        for layer in layers:
            host_pool.load_to_device_per_layer(
                device_pool, host.cuda(), load_locs.cuda(), layer, "direct"
            )
    cuda.synchronize()
    assert runners >= 1 and len(runners_of) >= runners
    for (name, layer), rows in backed_up.items():
        assert torch.equal(host_pool.read_rows(name, layer, host), rows)
        assert torch.equal(device_pool.read_rows(name, layer, load_locs), rows)


@NEEDS_TRITON
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_auto_on_page_first_launches_sixteen_programs_per_component(
    cuda: CudaDevice, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # page_first refuses the copy engine, so auto runs the kernel with 16 programs per
    # component it moves (copy_choice.auto_triton_programs); an explicit triton launch over the
    # same indices keeps the default grid in a closure of its own, and both land every row
    from hicache_ref.pools import fast_transfer

    launched: list[tuple[object, int]] = []
    original = fast_transfer.prepare_row_copy

    def spy(**kwargs: object) -> object:
        launched.append((kwargs["grid"], len(kwargs["host_buffers"])))  # type: ignore[arg-type]
        return original(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fast_transfer, "prepare_row_copy", spy)
    device_pool, host_pool = gpu_pools(cuda, kind, "page_first", 16, "auto")
    assert host_pool.describe_auto_copy_path() == "triton 16/component"
    host, backup_locs, load_locs = index_pairs("kernel", "page_first", 16)
    layers, names = range(device_pool.layer_num), device_pool.component_names()
    backed_up = {
        (n, layer): device_pool.read_rows(n, layer, backup_locs) for n in names for layer in layers
    }
    with cuda.stream(cuda.Stream()):
        host_pool.backup_from_device_all_layer(device_pool, host, backup_locs, "kernel")
        host_pool.load_to_device_per_layer(device_pool, host, load_locs, 0, "kernel")
        auto_launches = list(launched)
        host_pool.copy_path = "triton"
        host_pool.load_to_device_per_layer(device_pool, host, load_locs, 0, "kernel")
    cuda.synchronize()
    assert auto_launches and all(grid == 16 * moved for grid, moved in auto_launches)
    assert launched[len(auto_launches) :] and all(
        grid == TRITON_GRID_DEFAULT for grid, _ in launched[len(auto_launches) :]
    )  # the host pool's triton_launch (the default grid) for the explicit path
    for (name, layer), rows in backed_up.items():
        assert torch.equal(host_pool.read_rows(name, layer, host), rows)
        if layer == 0:
            assert torch.equal(device_pool.read_rows(name, layer, load_locs), rows)


@pytest.mark.parametrize("threaded", [True, False], ids=["issuing-thread", "inline"])
def test_batch_copies_run_between_the_work_before_and_after_them_on_their_stream(
    cuda: CudaDevice, threaded: bool
) -> None:
    # a long spin, then a fill, then the backup, then an overwrite, all on one stream: the
    # host must hold the fill (copies after the earlier work, the overwrite after the copies);
    # then a load into other rows and a read of them on the stream, which must see the host rows
    copier = load_cuda_batch_copier()
    if threaded and not copier.threaded:
        pytest.fail(f"the issuing thread is unavailable here: {copier.threaded_missing}")
    saved = copier.threaded
    copier.threaded = threaded
    try:
        device_pool, host_pool = gpu_pools(cuda, "mha", "layer_first", 4, "batch")
        host, backup_locs, load_locs = index_pairs("direct", "layer_first", 4)
        backup_cuda, load_cuda = backup_locs.cuda(), load_locs.cuda()
        stream = cuda.Stream()
        seen = []
        with cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            for name in device_pool.component_names():
                for layer in range(device_pool.layer_num):
                    device_pool.component_buffer(name, layer)[backup_cuda] = layer + 1.0
            host_pool.backup_from_device_all_layer(device_pool, host, backup_locs, "direct")
            for name in device_pool.component_names():
                for layer in range(device_pool.layer_num):
                    device_pool.component_buffer(name, layer)[backup_cuda] = -5.0
            for layer in range(device_pool.layer_num):
                host_pool.load_to_device_per_layer(device_pool, host, load_locs, layer, "direct")
                seen.append(device_pool.component_buffer("k", layer)[load_cuda].clone())
        stream.synchronize()
        for name in device_pool.component_names():
            for layer in range(device_pool.layer_num):
                assert host_pool.read_rows(name, layer, host).eq(layer + 1.0).all(), (name, layer)
        for layer, rows in enumerate(seen):
            assert rows.eq(layer + 1.0).all(), layer  # the load read the backed-up rows
    finally:
        copier.threaded = saved


@pytest.mark.parametrize("threaded", [True, False], ids=["issuing-thread", "inline"])
def test_layers_loaded_in_one_go_keep_each_layer_event_after_its_copies(
    cuda: CudaDevice, threaded: bool
) -> None:
    # a long spin, then every layer in one call with an event recorded after each layer and a
    # read of that layer right behind it, all on one stream: each read sees its layer loaded;
    # an event of a later layer is not complete while the spin holds the stream
    copier = load_cuda_batch_copier()
    if threaded and not copier.threaded:
        pytest.fail(f"the issuing thread is unavailable here: {copier.threaded_missing}")
    saved = copier.threaded
    copier.threaded = threaded
    try:
        device_pool, host_pool = gpu_pools(cuda, "mha", "layer_first", 4, "batch")
        host, _, load_locs = index_pairs("direct", "layer_first", 4)
        load_cuda = load_locs.cuda()
        for layer in range(device_pool.layer_num):
            for name in device_pool.component_names():
                host_pool.write_rows(name, layer, host, torch.tensor(layer + 7.0))
                device_pool.component_buffer(name, layer)[load_cuda] = -1.0
        stream = cuda.Stream()
        events = [torch.cuda.Event() for _ in range(device_pool.layer_num)]
        seen: list[torch.Tensor] = []

        def after_layer(layer: int) -> None:
            events[layer].record()
            seen.append(device_pool.component_buffer("v", layer)[load_cuda].clone())

        with cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            host_pool.load_to_device_layers(
                device_pool, host, load_locs, range(device_pool.layer_num), "direct", after_layer
            )
            done = device_pool.component_buffer("k", device_pool.layer_num - 1)[load_cuda].clone()
        assert not events[-1].query()  # behind the spin
        stream.synchronize()
        assert all(event.query() for event in events)
        assert [rows.eq(layer + 7.0).all().item() for layer, rows in enumerate(seen)] == [
            True
        ] * device_pool.layer_num
        assert done.eq(device_pool.layer_num + 6.0).all()
    finally:
        copier.threaded = saved


def test_a_load_records_its_layer_events_in_one_native_call_once_they_exist(
    cuda: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the controller hands its layer events as LayerRecords: the first load creates them through
    # Python (a CUDA event has no handle before its first record), every later load waits and
    # records in one native call. A reader stream waiting on layer k's event must see layer k
    # loaded although the load stream is held behind a spin when the waits are queued.
    copier = load_cuda_batch_copier()
    if not copier.threaded:
        pytest.fail(f"the issuing thread is unavailable here: {copier.threaded_missing}")
    device_pool, host_pool = gpu_pools(cuda, "mha", "layer_first", 4, "batch")
    host, _, load_locs = index_pairs("direct", "layer_first", 4)
    load_cuda = load_locs.cuda()
    layers = range(device_pool.layer_num)
    events = [torch.cuda.Event() for _ in layers]
    records = LayerRecords({layer: (events[layer],) for layer in layers})
    native: list[int] = []
    wait_record = CopyIssuer.wait_record

    def counted(self: CopyIssuer, *args: int) -> None:
        native.append(args[2])  # the layers of the call
        wait_record(self, *args)

    monkeypatch.setattr(CopyIssuer, "wait_record", counted)
    stream, reader = cuda.Stream(), cuda.Stream()
    for value in (7.0, 9.0):
        for layer in layers:
            for name in device_pool.component_names():
                host_pool.write_rows(name, layer, host, torch.tensor(layer + value))
                device_pool.component_buffer(name, layer)[load_cuda] = -1.0
        cuda.synchronize()
        with cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            host_pool.load_to_device_layers(device_pool, host, load_locs, layers, "direct", records)
        seen = []
        with cuda.stream(reader):
            for layer in layers:
                reader.wait_event(events[layer])
                seen.append(device_pool.component_buffer("v", layer)[load_cuda].clone())
        assert not events[-1].query()  # behind the spin
        cuda.synchronize()
        loaded = [rows.eq(layer + value).all().item() for layer, rows in enumerate(seen)]
        assert loaded == [True] * len(layers), value
    assert native == [len(layers)]  # the second load only: one call for every layer


def test_batch_inside_graph_capture_is_refused_in_one_line(cuda: CudaDevice) -> None:
    # the issuing thread's copies could not enter a graph the caller's stream operations enter
    copier = load_cuda_batch_copier()
    if not copier.threaded:
        pytest.fail(f"the issuing thread is unavailable here: {copier.threaded_missing}")
    device_pool, host_pool = gpu_pools(cuda, "mla", "layer_first", 4, "batch")
    host, _, load_locs = index_pairs("direct", "layer_first", 4)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(HiCacheInputError, match="cannot be captured into a CUDA graph"):
        with torch.cuda.graph(graph, stream=stream):
            host_pool.load_to_device_per_layer(device_pool, host, load_locs, 0, "direct")
    cuda.synchronize()
    host_pool.load_to_device_per_layer(device_pool, host, load_locs, 0, "direct")  # still works
    cuda.synchronize()
    assert torch.equal(
        device_pool.read_rows("kv", 0, load_locs), host_pool.read_rows("kv", 0, host)
    )
