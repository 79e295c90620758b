"""What ``copy_path="auto"`` picks: ``gather`` on the CPU; on a GPU the copy engine where the
layout and copy size suit it and the runtime has it, the Triton kernel where it does not, and
``runs`` where neither can run. The runtime's capabilities are handed in (or the probe is
replaced), so every branch is shown on a CPU-only machine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.pools import copy_choice
from hicache_ref.pools.copy_choice import (
    BATCH_PAGE_COPY_BYTES_MIN,
    CopyRuntime,
    auto_triton_programs,
    choose_auto_copy_path,
    choose_gpu_copy_path,
    compute_page_copy_bytes,
    describe_copy_runtime,
    probe_copy_runtime,
)
from hicache_ref.pools.host_layout import HostLayout
from hicache_ref.pools.transfer import resolve_copy_path
from hicache_ref.pools.triton_copy import is_triton_available

from .builders import make_pools

EVERYTHING = CopyRuntime(batch=True, triton=True)
NO_BATCH = CopyRuntime(batch=False, triton=True, batch_missing="CUDA 12.4")
NOTHING = CopyRuntime(batch=False, triton=False, batch_missing="CUDA 12.4")
MLA_PAGE_64 = {"kv": 64 * 576 * 2}  # 73,728 B: the measured 98-99% case
MLA_PAGE_16 = {"kv": 16 * 576 * 2}  # 18,432 B: batch measured at 7% H2D


def gpu(
    layout: HostLayout, copies: dict[str, int], runtime: CopyRuntime, pinned: bool = True
) -> str:
    return choose_gpu_copy_path(
        layout=layout, page_copy_bytes=copies, host_pinned=pinned, runtime=runtime
    )


def test_large_page_copies_go_to_the_copy_engine_where_the_layout_keeps_rows_in_runs() -> None:
    for layout in ("layer_first", "page_first_direct", "layer_page_first"):
        assert gpu(layout, MLA_PAGE_64, EVERYTHING) == "batch"
    # page_first interleaves layers and page_head splits heads: one copy per row, the kernel's
    assert gpu("page_first", MLA_PAGE_64, EVERYTHING) == "triton"
    assert gpu("page_head", {"k": 64 * 1024, "v": 64 * 1024}, EVERYTHING) == "triton"


def test_small_page_copies_go_to_the_kernel_even_with_the_copy_engine_present() -> None:
    assert gpu("layer_first", MLA_PAGE_16, EVERYTHING) == "triton"
    # one small component (an NSA index sidecar) is enough: the engine pays per copy
    assert gpu("layer_first", {"kv": 73_728, "index_k": 8_192}, EVERYTHING) == "triton"
    # the threshold itself counts as large
    assert gpu("layer_first", {"kv": BATCH_PAGE_COPY_BYTES_MIN}, EVERYTHING) == "batch"
    assert gpu("layer_first", {"kv": BATCH_PAGE_COPY_BYTES_MIN - 1}, EVERYTHING) == "triton"


def test_without_the_batch_api_the_kernel_and_without_triton_runs() -> None:
    assert gpu("layer_first", MLA_PAGE_64, NO_BATCH) == "triton"
    assert gpu("layer_first", MLA_PAGE_64, NOTHING) == "runs"
    assert gpu("page_first", MLA_PAGE_64, CopyRuntime(batch=True, triton=False)) == "runs"


def test_the_kernel_needs_a_pinned_host_pool_and_the_copy_engine_does_not() -> None:
    assert gpu("layer_first", MLA_PAGE_16, EVERYTHING, pinned=False) == "runs"
    assert gpu("layer_first", MLA_PAGE_64, EVERYTHING, pinned=False) == "batch"


def on_cpu_pools(*, all_cpu: bool, runtime: CopyRuntime) -> str:
    return choose_auto_copy_path(
        layout="layer_first",
        page_copy_bytes=MLA_PAGE_64,
        device_type="cpu",
        host_pinned=True,
        all_cpu=all_cpu,
        runtime=runtime,
    )


def test_on_the_cpu_auto_stays_gather_and_a_cuda_index_makes_it_runs() -> None:
    for runtime in (EVERYTHING, NOTHING):
        assert on_cpu_pools(all_cpu=True, runtime=runtime) == "gather"
        assert on_cpu_pools(all_cpu=False, runtime=runtime) == "runs"


def test_page_copy_bytes_are_one_page_of_each_component() -> None:
    shapes = {"kv": (1, 576), "index_k": (1, 132)}
    assert compute_page_copy_bytes(shapes, 2, 64) == {"kv": 73_728, "index_k": 16_896}


CUDA = torch.device("cuda", 0)  # a device name: constructing it needs no GPU


@dataclass
class _CudaPoolStub:
    """What ``resolve_copy_path`` reads of a device pool, on a CUDA device (no GPU needed)."""

    rows: dict[str, tuple[int, ...]]
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = CUDA

    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.rows


def test_resolution_on_a_cuda_pool_asks_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # the process's capabilities come from probe_copy_runtime: replace it
    monkeypatch.setattr(copy_choice, "probe_copy_runtime", lambda: NO_BATCH)
    pool = _CudaPoolStub({"kv": (1, 576)})
    common = dict(host_buffers={}, page_size=64, all_cpu=False, host_pinned=True)
    assert resolve_copy_path("auto", device_pool=pool, layout="layer_first", **common) == "triton"  # type: ignore[arg-type]
    monkeypatch.setattr(copy_choice, "probe_copy_runtime", lambda: EVERYTHING)
    assert resolve_copy_path("auto", device_pool=pool, layout="layer_first", **common) == "batch"  # type: ignore[arg-type]
    # a path given explicitly is never second-guessed
    assert resolve_copy_path("runs", device_pool=pool, layout="layer_first", **common) == "runs"  # type: ignore[arg-type]


def test_auto_gives_page_first_sixteen_kernel_programs_per_component() -> None:
    # page_first scatters a layer's rows over the host span: MLA (one component) gets 16
    # programs, MHA (K and V in one launch) 32, the grids measured at 92-93% of pinned H2D
    assert auto_triton_programs("page_first") == 16
    # every other layout keeps the default grid, shared by the launch's components
    for layout in ("layer_first", "page_first_direct", "layer_page_first", "page_head"):
        assert auto_triton_programs(layout) is None


def test_a_simulated_host_pool_reports_gather_for_auto_and_its_own_path_otherwise() -> None:
    _, auto_pool = make_pools("mla", SimDevice(), copy_path="auto")
    _, runs_pool = make_pools("mla", SimDevice(), copy_path="runs")
    assert auto_pool.chosen_copy_path() == auto_pool.auto_copy_path() == "gather"
    assert auto_pool.describe_auto_copy_path() == "gather"  # no grid where no kernel runs
    assert runs_pool.chosen_copy_path() == "runs" and runs_pool.auto_copy_path() == "gather"


def test_the_probe_reports_what_this_process_has() -> None:
    runtime = probe_copy_runtime()
    assert runtime.triton == is_triton_available()
    if not torch.cuda.is_available():
        assert not runtime.batch and runtime.batch_missing == "no CUDA device"
    assert describe_copy_runtime(NO_BATCH) == "no batch (CUDA 12.4), triton, runs"
    assert describe_copy_runtime(EVERYTHING) == "batch (cudaMemcpyBatchAsync), triton, runs"
