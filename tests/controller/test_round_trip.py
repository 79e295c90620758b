"""Byte round trips through the controller: write -> ack -> evict -> load -> the same bytes (INV-06).

Every legal (io_backend, layout) pair x pool kind (MHA, MLA, NSA with its index sidecar) x page
size, with draft pools whose layer count is smaller and larger than the target's, and under CP
with 1, 2 and 4 simulated ranks sharing one device. The CUDA twins at the bottom run a subset on
``CudaDevice`` with real streams; on a CPU-only machine they are skipped.

The host layouts ``layer_page_first`` (direct, every pool kind, CP included) and ``page_head``
(kernel, MHA only) are in every parametrization, like the others.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache_ref.device import CudaDevice, DeviceModule, SimDevice, cuda_available
from hicache_ref.invariants.models import HiCacheWriteReservation

from .rig import ATTACH_MODES, LEGAL_PAIRS, POOL_KINDS, TARGET_LAYERS, build_cp_rigs, build_rig
from .round_trips import (
    CP_WRITE_PATHS,
    HeldWriteController,
    assert_cp_round_trip,
    assert_write_evict_load_round_trip,
)

PAGE_SIZES = [1, 4, 16]
SMALLER_AND_LARGER_DRAFT = [TARGET_LAYERS - 2, TARGET_LAYERS + 2]
NEW_LAYOUT_CASES = [
    *(("direct", "layer_page_first", kind) for kind in POOL_KINDS),
    ("kernel", "page_head", "mha"),  # page_head is MHA-only, as upstream
]
"""(io_backend, layout, pool kind) of the issue 9 layouts."""


ONE_RANK_CASES = [
    *((io_backend, layout, kind) for io_backend, layout in LEGAL_PAIRS for kind in POOL_KINDS),
    *NEW_LAYOUT_CASES,
]
"""Every legal (io_backend, layout, pool kind) for one rank."""
CP_PAIRS = [*LEGAL_PAIRS, ("direct", "layer_page_first")]
"""Every legal (io_backend, layout) for CP ranks (NSA pools: no page_head)."""


# -- one rank ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("io_backend", "layout", "kind"), ONE_RANK_CASES)
def test_write_then_load_round_trips_every_layer(
    io_backend: str, layout: str, kind: str, page_size: int
) -> None:
    rig = build_rig(
        SimDevice(seed=page_size),
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        page_size=page_size,
        controller_class=HeldWriteController,
    )
    assert_write_evict_load_round_trip(rig, merged=False)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("io_backend", "layout", "kind"), ONE_RANK_CASES)
def test_writes_merged_by_start_writing_round_trip_with_one_ack(
    io_backend: str, layout: str, kind: str, page_size: int
) -> None:
    rig = build_rig(
        SimDevice(seed=page_size + 1),
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        page_size=page_size,
        controller_class=HeldWriteController,
    )
    assert_write_evict_load_round_trip(rig, merged=True)


@pytest.mark.parametrize("attach", ATTACH_MODES)
@pytest.mark.parametrize("draft_layer_num", SMALLER_AND_LARGER_DRAFT)
@pytest.mark.parametrize(("io_backend", "layout", "kind"), ONE_RANK_CASES)
def test_draft_rows_round_trip_with_the_target(
    io_backend: str, layout: str, kind: str, draft_layer_num: int, attach: str
) -> None:
    rig = build_rig(
        SimDevice(seed=draft_layer_num),
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        draft_layer_num=draft_layer_num,
        attach=attach,
        controller_class=HeldWriteController,
    )
    assert rig.controller.has_draft
    assert rig.controller.draft_layer_num == draft_layer_num
    assert_write_evict_load_round_trip(rig, merged=True)


# -- CP ranks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CP_WRITE_PATHS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize(("io_backend", "layout"), CP_PAIRS)
def test_cp_ranks_round_trip_their_owned_pages(
    io_backend: str, layout: str, cp_size: int, page_size: int, path: str
) -> None:
    rigs = build_cp_rigs(
        SimDevice(seed=cp_size),
        cp_size,
        page_size=page_size,
        layout=layout,
        io_backend=io_backend,
        device_pages=32,
    )
    assert_cp_round_trip(rigs, path=path)


@pytest.mark.parametrize("path", CP_WRITE_PATHS)
@pytest.mark.parametrize("draft_layer_num", SMALLER_AND_LARGER_DRAFT)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize(("io_backend", "layout"), CP_PAIRS)
def test_cp_ranks_round_trip_draft_rows_too(
    io_backend: str, layout: str, cp_size: int, draft_layer_num: int, path: str
) -> None:
    rigs = build_cp_rigs(
        SimDevice(seed=cp_size),
        cp_size,
        page_size=4,
        layout=layout,
        io_backend=io_backend,
        device_pages=32,
        draft_layer_num=draft_layer_num,
        attach=ATTACH_MODES[cp_size % len(ATTACH_MODES)],
    )
    assert_cp_round_trip(rigs, path=path)


def test_one_page_node_on_four_ranks_acks_on_the_three_zero_owned_ranks() -> None:
    # a one-page node is owned by one rank; the other three still ack it (INV-14)
    rigs = build_cp_rigs(SimDevice(), 4, page_size=4, device_pages=32, draft_layer_num=5)
    value = rigs[0].allocator.alloc(4)
    assert value is not None
    for rig in rigs[1:]:
        assert rig.allocator.alloc(4) is not None
    owners = []
    for rig in rigs:
        reservation = rig.controller.reserve_write_cp(value, node_id=3)
        assert isinstance(reservation, HiCacheWriteReservation)
        owners.append(len(reservation.host_indices) > 0)
        rig.controller.submit_write_cp_per_layer(reservation)
    assert sorted(owners) == [False, False, False, True]
    for rig in rigs:
        assert [list(a.node_ids) for a in rig.controller.ack_write_queue] == [[3]]


# -- the same round trips on a GPU -------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


@pytest.fixture
def cuda() -> Iterator[DeviceModule]:
    device = CudaDevice()
    yield device
    device.synchronize()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(("io_backend", "layout", "kind"), ONE_RANK_CASES)
def test_write_then_load_round_trips_on_the_gpu(
    cuda: DeviceModule, io_backend: str, layout: str, kind: str
) -> None:
    rig = build_rig(
        cuda,
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        page_size=4,
        draft_layer_num=TARGET_LAYERS + 2,
        controller_class=HeldWriteController,
    )
    assert_write_evict_load_round_trip(rig, merged=True)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("kind", POOL_KINDS)
def test_a_load_without_draft_copies_goes_to_the_copy_engine_in_one_go_on_the_gpu(
    cuda: DeviceModule, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no draft pool: the controller hands every target layer to the host pool at once, which
    # on a GPU and the batch path is one stepped entry of the issuing thread; the round trip's
    # bytes and acks are the per-layer loop's
    from hicache_ref.pools.copy_engine import CudaBatchCopier, load_cuda_batch_copier

    if not load_cuda_batch_copier().threaded:
        pytest.fail(f"no issuing thread here: {load_cuda_batch_copier().threaded_missing}")
    stepped: list[tuple[int, int | None]] = []
    original = CudaBatchCopier.issue_rows_stepped

    def counted(self, rows, device, after_row, start=0, stop=None):  # type: ignore[no-untyped-def]
        stepped.append((start, stop))
        original(self, rows, device, after_row, start, stop)

    monkeypatch.setattr(CudaBatchCopier, "issue_rows_stepped", counted)
    rig = build_rig(
        cuda, kind=kind, page_size=4, controller_class=HeldWriteController, copy_path="batch"
    )  # at page size 4 `auto` takes the kernel
    assert_write_evict_load_round_trip(rig, merged=True)
    assert stepped and all(span == (0, TARGET_LAYERS) for span in stepped)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("path", CP_WRITE_PATHS)
@pytest.mark.parametrize("cp_size", [1, 4])
@pytest.mark.parametrize(("io_backend", "layout"), CP_PAIRS)
def test_cp_ranks_round_trip_on_the_gpu(
    cuda: DeviceModule, io_backend: str, layout: str, cp_size: int, path: str
) -> None:
    rigs = build_cp_rigs(
        cuda,
        cp_size,
        page_size=4,
        layout=layout,
        io_backend=io_backend,
        device_pages=32,
        draft_layer_num=TARGET_LAYERS - 2,
    )
    assert_cp_round_trip(rigs, path=path)
