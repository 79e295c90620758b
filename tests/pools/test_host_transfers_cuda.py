"""The same transfers on a real GPU: run-merged ``copy_(non_blocking=True)`` slices, and the
default ``auto`` (whichever path it picks here), between pinned host buffers and CUDA device
buffers, ordered on the current stream, with CUDA index tensors where upstream passes them
(``kernel`` moves host indices to the GPU), for every legal (io_backend, layout, pool kind),
``page_head`` (strided run views) and ``layer_page_first`` included. The page checks and the CP
layout must not synchronise on CUDA tensors (``torch.cuda.set_sync_debug_mode``). A GPU
asserts what ``auto`` picks for the measured cases (``copy_choice``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache_ref.device import CudaDevice, cuda_available
from hicache_ref.pools import (
    CpSharedKVLayout,
    MLATokenToKVPool,
    make_host_pool,
    pad_token_locs_to_page_boundary,
    validate_page_aligned_token_indices,
)
from hicache_ref.pools.copy_choice import describe_copy_runtime, probe_copy_runtime

from .builders import fill_device_rows, make_device_pool, pages_to_locs, row_values
from .test_host_transfers import LEGAL_CASES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def cuda() -> Iterator[CudaDevice]:
    device = CudaDevice()
    yield device
    device.synchronize()


@pytest.fixture
def no_sync() -> Iterator[None]:
    """Any host synchronisation inside the block raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(("io_backend", "layout", "kind"), LEGAL_CASES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("copy_path", ["runs", "auto"])
def test_round_trip_on_the_gpu(
    cuda: CudaDevice, io_backend: str, layout: str, kind: str, page_size: int, copy_path: str
) -> None:
    # runs: the run-merged slice copies; auto: the default, whatever it picks on this GPU
    device_pool = make_device_pool(kind, cuda, size=8 * page_size, page_size=page_size)
    host_pool = make_host_pool(
        device_pool, layout=layout, size_tokens=8 * page_size, copy_path=copy_path
    )
    assert host_pool.pin_memory and host_pool.buffers[host_pool.component_names()[0]].is_pinned()
    assert host_pool.chosen_copy_path() != "gather"  # gather is CPU-only
    device_locs = pages_to_locs([5, 2, 7, 8], page_size)
    host_slots = pages_to_locs([6, 1, 3, 2], page_size)
    load_locs = pages_to_locs([1, 4, 6, 5], page_size)
    fill_device_rows(device_pool, device_locs, seed=1)
    # the kernel backend hands CUDA host indices (move_indices), the direct backend CPU ones
    host_arg = host_slots.cuda() if io_backend == "kernel" else host_slots
    write_stream, load_stream = cuda.Stream(), cuda.Stream()
    with cuda.stream(write_stream):
        host_pool.backup_from_device_all_layer(
            device_pool, host_arg, device_locs.cuda(), io_backend
        )
    write_stream.synchronize()
    with cuda.stream(load_stream):
        for layer in range(device_pool.layer_num):
            host_pool.load_to_device_per_layer(
                device_pool, host_arg, load_locs.cuda(), layer, io_backend
            )
    load_stream.synchronize()
    for component in device_pool.component_names():
        for layer in range(device_pool.layer_num):
            expected = row_values(device_pool, component, layer, device_locs, seed=1)
            assert torch.equal(host_pool.read_rows(component, layer, host_slots), expected)
            assert torch.equal(device_pool.read_rows(component, layer, load_locs), expected)


def test_page_checks_and_cp_layout_do_not_sync_on_cuda(no_sync: None) -> None:
    locs = torch.arange(4, 12, device="cuda")
    validate_page_aligned_token_indices(locs, 4, "device_indices")
    padded = pad_token_locs_to_page_boundary(locs[:6], 4, "locs")
    layout = CpSharedKVLayout(cp_size=2, cp_rank=1, page_size=4)
    owned = layout.owned_by_this_rank(padded)
    physical = layout.logical_locs_to_physical(padded)
    owners = layout.owner_for_logical_pages(torch.div(padded[::4], 4, rounding_mode="floor"))
    torch.cuda.set_sync_debug_mode("default")
    assert padded.tolist() == list(range(4, 12))
    assert owned.tolist() == [True] * 4 + [False] * 4
    assert physical.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert owners.tolist() == [1, 0]


@pytest.mark.parametrize(
    ("layout", "page_size", "large"),
    [("layer_first", 64, True), ("page_first", 64, False), ("layer_first", 8, False)],
)
def test_auto_on_the_gpu_takes_the_measured_fastest_path(
    cuda: CudaDevice, layout: str, page_size: int, large: bool
) -> None:
    # MLA rows of 576 float32 (exact test values): page 64 copies 147,456 B (the copy engine's
    # case), page 8 18,432 B (as bf16 rows at page 16, where the engine was measured slow)
    runtime = probe_copy_runtime()
    device_pool = MLATokenToKVPool(8 * page_size, page_size, torch.float32, 512, 64, 2, cuda)
    host_pool = make_host_pool(device_pool, layout=layout, size_tokens=8 * page_size)
    kernel_or_runs = "triton" if runtime.triton else "runs"
    expected = "batch" if large and runtime.batch else kernel_or_runs
    assert host_pool.chosen_copy_path() == expected, describe_copy_runtime(runtime)
    # and it moves the bytes: device -> host -> other device pages
    device_locs, host_slots = (
        pages_to_locs([5, 2, 7], page_size),
        pages_to_locs([6, 1, 3], page_size),
    )
    load_locs = pages_to_locs([1, 4, 6], page_size)
    fill_device_rows(device_pool, device_locs, seed=3)
    backend = "kernel" if layout == "page_first" else "direct"
    stream = cuda.Stream()
    with cuda.stream(stream):
        host_pool.backup_from_device_all_layer(device_pool, host_slots, device_locs.cuda(), backend)
        for layer in range(device_pool.layer_num):
            host_pool.load_to_device_per_layer(
                device_pool, host_slots, load_locs.cuda(), layer, backend
            )
    stream.synchronize()
    for layer in range(device_pool.layer_num):
        expected_rows = row_values(device_pool, "kv", layer, device_locs, seed=3)
        assert torch.equal(device_pool.read_rows("kv", layer, load_locs), expected_rows)
