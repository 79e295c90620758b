"""The fast copy paths of a transfer: ``batch`` (the copy engine) and ``triton`` (a kernel).

``prepare_fast_transfer`` looks the transfer's plan up in ``PLAN_CACHE`` (same index tensors,
same in-place version: the per-layer loads of one batch), or validates the pairs (INV-01) and
builds one (``build_fast_plan``: byte offsets per component for ``batch``, device-side indices
for ``triton``), checks the buffers of every layer once, and returns a ``FastLaunch`` whose
``closure(layer_ids)`` is the stream work of those layers. ``batch`` builds the plan's
``DescriptorTable`` once per direction and pair of pools (every layer's source and destination
addresses, vectorized, every copy checked inside its buffers: ``BatchLayers``), so a layer's
closure is a range of the table's rows handed to ``cudaMemcpyBatchAsync``
(``copy_engine.issue_rows``, through the native issuing thread on CUDA) or to ``memmove`` (on
the simulator, when the stream runs); ``triton`` launches ``triton_copy``'s kernel per layer and
component, its arguments prepared once per layer set. ``transfer.launch_transfer`` decides which
path runs and refuses the layouts ``batch`` cannot move well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.pools.copy_engine import (
    CudaBatchCopier,
    RowBatches,
    load_cuda_batch_copier,
    memmove_copies,
)
from hicache_ref.pools.copy_plan import (
    ComponentCopies,
    DescriptorTable,
    HostRowGeometry,
    PlanCache,
    build_descriptor_table,
    check_contiguous,
    check_copies_in_bounds,
    compute_host_row_geometry,
    plan_component_copies,
    plan_row_runs,
)
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.host_layout import HostLayout, IoBackend, is_whole_page_transfer
from hicache_ref.pools.transfer_checks import (
    Direction,
    check_page_first_direct_chunks,
    check_transfer_indices,
)
from hicache_ref.pools.triton_copy import (
    TRITON_LAUNCH_DEFAULT,
    TritonLaunch,
    component_deltas,
    is_triton_available,
    prepare_row_copy,
)

FastCopyPath = Literal["batch", "triton"]

Stepped = Callable[[Sequence[int], Callable[[int], None]], None]
"""Stream work of consecutive layers with a callback after each (``BatchLayers.stepped``)."""

PLAN_CACHE = PlanCache()
"""Plans of the last few index-tensor pairs (see ``PlanCache``)."""


@dataclass(frozen=True)
class FastPlan:
    """What ``batch`` and ``triton`` reuse across launches with the same index tensors."""

    host: torch.Tensor
    """Validated host indices (CPU int64)."""
    device: torch.Tensor
    """Validated device indices (CPU int64)."""
    geometries: dict[str, HostRowGeometry]
    copies: dict[str, ComponentCopies]
    """``batch``: byte offsets per component (empty for ``triton``)."""
    kernel_indices: tuple[torch.Tensor, torch.Tensor] | None
    """``triton``: (host, device) indices on the device that runs the kernel."""
    closures: dict[tuple[object, ...], Callable[[], None]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """``triton``: launch closures already built from this plan, by ``_closure_key`` (the
    per-layer loads of one batch build each once). A closure keeps its buffers alive, so a key's
    addresses cannot be reused by another buffer while it is cached."""
    batches: dict[tuple[object, ...], BatchLayers] = field(
        default_factory=dict, compare=False, repr=False
    )
    """``batch``: the checked descriptor table of every layer, per direction and the addresses
    of both pools' buffers (``_batch_layers``)."""


@dataclass(frozen=True)
class BatchLayers:
    """A ``batch`` plan's ``DescriptorTable`` for one direction and pair of pools, every layer's
    copies checked inside their buffers: ``closure(layer_ids)`` moves those layers with no
    further check."""

    table: DescriptorTable
    device: torch.device
    copier: CudaBatchCopier | None
    """The process's copier (CUDA and at least one copy), else ``None``: ``memmove`` when the
    simulator's stream runs."""
    rows: RowBatches | None
    """Every layer's row for ``copier`` (a layer is a range of it: no tensor is sliced)."""

    def closure(self, layer_ids: Sequence[int]) -> Callable[[], None]:
        """The stream work of ``layer_ids`` (each a row of the table)."""
        copier, rows, device = self.copier, self.rows, self.device
        if copier is not None and rows is not None:
            if len(layer_ids) == 1:  # a per-layer load or backup
                layer = layer_ids[0]
                return functools.partial(copier.issue_rows, rows, device, layer, layer + 1)
            spans = _consecutive(layer_ids)
            if len(spans) == 1:
                start, stop = spans[0]
                return functools.partial(copier.issue_rows, rows, device, start, stop)

            def run_cuda() -> None:
                for start, stop in spans:
                    copier.issue_rows(rows, device, start, stop)

            return run_cuda
        table, layers = self.table, tuple(layer_ids)

        def run() -> None:
            for layer in layers:
                memmove_copies(table.dsts[layer], table.srcs[layer], table.sizes)

        return run

    def stepped(self) -> Stepped | None:
        """Consecutive layers through the issuing thread as one stepped entry
        (``CudaBatchCopier.issue_rows_stepped``), or ``None`` without a CUDA copier."""
        copier, rows, device = self.copier, self.rows, self.device
        if copier is None or rows is None:
            return None

        def run(layer_ids: Sequence[int], after_layer: Callable[[int], None]) -> None:
            spans = _consecutive(layer_ids)
            # Verify one ascending run of rows: a stepped entry is a range of the table
            assert len(spans) == 1 and list(layer_ids) == sorted(layer_ids), layer_ids
            start, stop = spans[0]
            copier.issue_rows_stepped(rows, device, after_layer, start, stop)

        return run


@dataclass(frozen=True)
class FastLaunch:
    """One ``batch`` or ``triton`` transfer checked and planned (``prepare_fast_transfer``)."""

    plan: FastPlan
    closure: Callable[[Sequence[int]], Callable[[], None]]
    """The stream work of the given layers (no check repeated)."""
    stepped: Stepped | None = None
    """``batch`` on CUDA: the given consecutive layers in order, ``after_layer(layer)`` on the
    current stream after each one's copies, the copy engine running them back to back."""


def _plan_key(
    *,
    copy_path: FastCopyPath,
    direction: Direction,
    layout: HostLayout,
    page_size: int,
    host_size: int,
    io_backend: IoBackend,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
) -> tuple[object, ...]:
    shapes = tuple([(name, buffer.shape) for name, buffer in host_buffers.items()])
    return (
        copy_path,
        direction,
        layout,
        page_size,
        host_size,
        io_backend,
        device_pool.size + device_pool.page_size,
        device_pool.layer_num,
        device_pool.dtype,
        device_pool.device,
        shapes,
    )


CLOSURES_PER_PLAN_MAX = 256
"""Closures one plan keeps (a per-layer load of 61 layers builds 61)."""


def _closure_key(
    direction: Direction,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    layer_ids: Sequence[int],
    shape: tuple[object, ...] | None,
) -> tuple[object, ...]:
    """What a closure depends on besides its plan: the buffers it moves between, by address
    and strides (so another view of the same memory is checked and built anew), and for
    ``triton`` the launch shape (grid, programs per component, tile) it was built for."""
    names = device_pool.component_names()
    buffers = [device_pool.component_buffer(n, layer) for layer in layer_ids for n in names]
    buffers += [host_buffers[n] for n in names]
    # list comprehensions: this runs on every launch, and genexprs into tuples cost more
    return (direction, tuple(layer_ids), shape, *[(b.data_ptr(), b.stride()) for b in buffers])


def _kernel_indices(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Contiguous int64 indices on ``device`` (a CPU tensor goes through pinned memory, so the
    copy does not block the host)."""
    values = indices.to(torch.int64).contiguous()
    if values.device == device:
        return values
    if device.type == "cuda" and values.device.type == "cpu":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


def build_fast_plan(
    *,
    copy_path: FastCopyPath,
    host: torch.Tensor,
    device: torch.Tensor,
    layout: HostLayout,
    page_size: int,
    host_size: int,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
) -> FastPlan:
    """Geometry per component, then byte offsets (``batch``) or kernel indices (``triton``)."""
    row_shapes = device_pool.component_row_shapes()
    geometries = {
        name: compute_host_row_geometry(
            layout, host_size, device_pool.layer_num, page_size, row_shapes[name]
        )
        for name in device_pool.component_names()
    }
    if copy_path == "triton":
        target = device_pool.device
        return FastPlan(
            host,
            device,
            geometries,
            {},
            (_kernel_indices(host_indices, target), _kernel_indices(device_indices, target)),
        )
    first = geometries[device_pool.component_names()[0]]
    runs = plan_row_runs(first, host, device)
    copies = {
        name: plan_component_copies(name, runs, geometry, host_buffers[name].element_size())
        for name, geometry in geometries.items()
    }
    return FastPlan(host, device, geometries, copies, None)


def _check_fast_buffers(
    copy_path: FastCopyPath, host_buffers: dict[str, torch.Tensor], device_pool: KVCache
) -> None:
    """The executor exists here, and every buffer of every layer is where and how the pointer
    arithmetic (or the kernel) needs it: checked once per transfer, not per layer."""
    on_gpu = device_pool.device.type == "cuda"
    # Verify the executor exists here (Triton installed) and the host pool is where it reads
    if copy_path == "triton" and not is_triton_available():
        raise HiCacheInputError(
            "copy_path='triton' needs the triton package (pip install triton); "
            "use copy_path='batch' or 'runs'"
        )
    for name, buffer in host_buffers.items():
        check_contiguous(buffer, f"host buffer {name!r}")
        if buffer.device.type != "cpu":
            raise HiCacheInputError(
                f"copy_path={copy_path!r} moves between a CPU host pool and a device pool; host "
                f"buffer {name!r} is on {buffer.device}"
            )
        if copy_path == "triton" and on_gpu and not buffer.is_pinned():
            raise HiCacheInputError(
                f"copy_path='triton' reads host buffer {name!r} from the GPU, so it must be "
                "pinned (pin_memory=True); use copy_path='batch' or 'runs' for pageable memory"
            )
    for name in device_pool.component_names():
        for buffer in device_pool.component_buffers(name):
            if not buffer.is_contiguous():  # the message is built only for a refusal
                check_contiguous(buffer, f"device buffer {name!r}")


BATCHES_PER_PLAN_MAX = 8
"""Tables one plan keeps (one per direction and pair of pools that moved its pairs)."""


def _batch_layers(
    *,
    direction: Direction,
    plan: FastPlan,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
) -> BatchLayers:
    """The plan's table for these buffers: built for every layer of the pool on first use, with
    every copy of every layer checked inside its two buffers (INV-06), then reused."""
    names = device_pool.component_names()
    per_component = [device_pool.component_buffers(n) for n in names]
    device_bases = tuple(
        zip(*[[b.data_ptr() for b in layers] for layers in per_component], strict=True)
    )
    host_key = tuple([(host_buffers[n].data_ptr(), host_buffers[n].stride()) for n in names])
    key = (direction, host_key, device_bases)
    found = plan.batches.get(key)
    if found is not None:
        return found
    for name, layers in zip(names, per_component, strict=True):
        # the last layer reaches furthest into the host buffer (layer bases only grow)
        check_copies_in_bounds(
            plan.copies[name],
            host_buffer=host_buffers[name],
            device_buffer_nbytes=min(b.numel() * b.element_size() for b in layers),
            layer_id=len(layers) - 1,
        )
    table = build_descriptor_table(
        [plan.copies[n] for n in names],
        host_bases=[host_buffers[n].data_ptr() for n in names],
        device_bases=[list(bases) for bases in device_bases],
        d2h=direction == "d2h",
    )
    device = device_pool.device
    copier: CudaBatchCopier | None = None
    rows: RowBatches | None = None
    if device.type == "cuda" and table.sizes.numel() > 0:
        copier = load_cuda_batch_copier()
        index = 0 if device.index is None else device.index
        rows = RowBatches(table.dsts, table.srcs, table.sizes, direction == "d2h", index)
    found = BatchLayers(table, device, copier, rows)
    if len(plan.batches) >= BATCHES_PER_PLAN_MAX:
        plan.batches.clear()
    plan.batches[key] = found
    return found


def _consecutive(layer_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``layer_ids`` as ``[start, stop)`` runs of consecutive ascending layers."""
    runs: list[tuple[int, int]] = []
    for layer in layer_ids:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def _launch_groups(
    plan: FastPlan,
    host_buffers: dict[str, torch.Tensor],
    layer_buffers: dict[str, list[torch.Tensor]],
) -> list[tuple[str, ...]]:
    """Components that share one kernel launch: MHA's K and V when their geometry and dtype
    match and their buffers sit a whole number of 16-byte vectors apart on both sides (on every
    layer); otherwise one launch per component."""
    names = tuple(layer_buffers)
    if len(names) == 2:
        first, second = names
        same_rows = plan.geometries[first] == plan.geometries[second]
        same_dtype = host_buffers[first].dtype == host_buffers[second].dtype
        pairs = [[host_buffers[first], host_buffers[second]]] + [
            [a, b] for a, b in zip(layer_buffers[first], layer_buffers[second], strict=True)
        ]
        if same_rows and same_dtype and all(component_deltas(p, 1) is not None for p in pairs):
            return [names]
    return [(name,) for name in names]


def _triton_closure(
    *,
    direction: Direction,
    plan: FastPlan,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    layer_ids: Sequence[int],
    programs_per_component: int | None,
    triton: TritonLaunch,
) -> Callable[[], None]:
    assert plan.kernel_indices is not None
    host_indices, device_indices = plan.kernel_indices
    layer_buffers = {
        name: [device_pool.component_buffer(name, layer) for layer in layer_ids]
        for name in device_pool.component_names()
    }
    per_group = [
        prepare_row_copy(
            host_buffers=[host_buffers[name] for name in group],
            device_buffers=[
                [layer_buffers[name][k] for name in group] for k in range(len(layer_ids))
            ],
            host_indices=host_indices,
            device_indices=device_indices,
            geometry=plan.geometries[group[0]],
            layer_ids=layer_ids,
            d2h=direction == "d2h",
            grid=triton.grid
            if programs_per_component is None
            else programs_per_component * len(group),
            tile=triton.tile,
        )
        for group in _launch_groups(plan, host_buffers, layer_buffers)
    ]
    # layer by layer, each layer's groups in order (a per-layer load lands layer l first)
    launches = [run for layer in zip(*per_group, strict=True) for run in layer]

    def run() -> None:
        for launch in launches:
            launch()

    return run


def _fast_plan(
    *,
    copy_path: FastCopyPath,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    layout: HostLayout,
    page_size: int,
    host_size: int,
    direction: Direction,
    io_backend: IoBackend,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
) -> FastPlan:
    """The cached plan of these index tensors, or validate (INV-01) and build one."""
    key = _plan_key(
        copy_path=copy_path,
        direction=direction,
        layout=layout,
        page_size=page_size,
        host_size=host_size,
        io_backend=io_backend,
        device_pool=device_pool,
        host_buffers=host_buffers,
    )
    cached = PLAN_CACHE.get(host_indices, device_indices, key)
    if isinstance(cached, FastPlan):
        return cached
    host, device = check_transfer_indices(
        host_indices,
        device_indices,
        direction=direction,
        host_size=host_size,
        device_rows=device_pool.size + device_pool.page_size,
    )
    if is_whole_page_transfer(io_backend, layout):
        check_page_first_direct_chunks(host, device, page_size)
    plan = build_fast_plan(
        copy_path=copy_path,
        host=host,
        device=device,
        layout=layout,
        page_size=page_size,
        host_size=host_size,
        host_buffers=host_buffers,
        device_pool=device_pool,
        host_indices=host_indices,
        device_indices=device_indices,
    )
    PLAN_CACHE.put(host_indices, device_indices, key, plan)
    return plan


def _triton_layers(
    layer_ids: Sequence[int],
    *,
    direction: Direction,
    plan: FastPlan,
    host_buffers: dict[str, torch.Tensor],
    device_pool: KVCache,
    programs_per_component: int | None,
    triton: TritonLaunch,
) -> Callable[[], None]:
    """The kernel launches of ``layer_ids``, built once per layer set and launch shape."""
    shape = (triton.grid, programs_per_component, triton.tile)
    key = _closure_key(direction, host_buffers, device_pool, layer_ids, shape)
    fn = plan.closures.get(key)
    if fn is None:
        fn = _triton_closure(
            direction=direction,
            plan=plan,
            host_buffers=host_buffers,
            device_pool=device_pool,
            layer_ids=layer_ids,
            programs_per_component=programs_per_component,
            triton=triton,
        )
        if len(plan.closures) >= CLOSURES_PER_PLAN_MAX:
            plan.closures.clear()
        plan.closures[key] = fn
    return fn


def prepare_fast_transfer(
    *,
    device_pool: KVCache,
    host_buffers: dict[str, torch.Tensor],
    layout: HostLayout,
    page_size: int,
    host_size: int,
    direction: Direction,
    io_backend: IoBackend,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    copy_path: FastCopyPath,
    programs_per_component: int | None = None,
    triton: TritonLaunch = TRITON_LAUNCH_DEFAULT,
) -> FastLaunch:
    """Check and plan one ``batch`` or ``triton`` transfer (or reuse its plan): the pairs
    (INV-01), the buffers of every layer, and for ``batch`` every copy of every layer inside
    its buffers (INV-06); ``programs_per_component`` sizes each Triton launch by the components
    it moves (default: ``triton.grid`` programs shared by them); ``triton`` is the launch shape
    of the kernel path (ignored by ``batch``)."""
    plan = _fast_plan(
        copy_path=copy_path,
        device_pool=device_pool,
        host_buffers=host_buffers,
        layout=layout,
        page_size=page_size,
        host_size=host_size,
        direction=direction,
        io_backend=io_backend,
        host_indices=host_indices,
        device_indices=device_indices,
    )
    _check_fast_buffers(copy_path, host_buffers, device_pool)
    if copy_path == "batch":
        batch = _batch_layers(
            direction=direction, plan=plan, host_buffers=host_buffers, device_pool=device_pool
        )
        return FastLaunch(plan, batch.closure, batch.stepped())
    closure = functools.partial(
        _triton_layers,
        direction=direction,
        plan=plan,
        host_buffers=host_buffers,
        device_pool=device_pool,
        programs_per_component=programs_per_component,
        triton=triton,
    )
    return FastLaunch(plan, closure)
