"""Every bad input gets a typed error naming the rule, and a refused call changes nothing.

Misuse raises a ``HiCacheInputError`` subclass whose message is pinned here; a capacity shortfall
is a value (``None`` / ``HiCacheWriteFailure``); a broken invariant raises ``InvariantViolation``
naming its id. After every refusal the device allocator, the host pools and the controller's
queues are exactly as before (INV-17).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.device import SimDevice
from hicache_ref.errors import (
    DoubleFreeError,
    DraftPoolPairError,
    ForeignSlotError,
    HiCacheInputError,
    LayerRangeError,
    MissingCpMetadataError,
    PageAlignmentError,
    UnknownOptionError,
)
from hicache_ref.invariants.models import HiCacheWriteFailure
from hicache_ref.pools import CpSharedKVLayout, make_host_pool

from .rig import CpNodeView, Rig, ack_rows, build_rig, drain_acks, make_device_pool, snapshot
from .steps import PAGE, alloc, backed_up, cp_rig, refused, reserve, sim_of

# -- index tensors ---------------------------------------------------------------------------------
BAD_INDICES = [
    pytest.param(
        torch.arange(4, 7),
        PageAlignmentError,
        r"INV-01: {name} has 3 token locations, not a multiple of page_size=4",
        id="partial-page",
    ),
    pytest.param(
        torch.arange(6, 10),
        PageAlignmentError,
        r"INV-01: {name} chunk 0 .* holds \[6, 7, 8, 9\]; a chunk must be one aligned page",
        id="misaligned-page",
    ),
    pytest.param(
        torch.tensor([-4, -3, -2, -1]),
        HiCacheInputError,
        r"{name} contains negative index -4",
        id="negative",
    ),
    pytest.param(
        torch.arange(4, 8, dtype=torch.float32),
        HiCacheInputError,
        r"{name} must be a 1-D int64/int32 tensor",
        id="float",
    ),
]


@pytest.mark.parametrize(("indices", "error", "match"), BAD_INDICES)
@pytest.mark.parametrize(
    ("verb", "name"),
    [("write", "device_indices"), ("load", "host_indices"), ("evict_host", "host_indices")],
)
def test_bad_indices_are_refused_and_allocate_nothing(
    verb: str, name: str, indices: torch.Tensor, error: type[BaseException], match: str
) -> None:
    # n1 backed up -> a verb with malformed indices -> typed error, nothing allocated or freed
    rig = build_rig(SimDevice())
    backed_up(rig, node_id=1)
    refused(
        rig,
        lambda: (
            getattr(rig.controller, verb)(indices, node_id=2)
            if verb != "evict_host"
            else rig.controller.evict_host(indices)
        ),
        error,
        match.format(name=name),
    )


def test_evict_host_supports_backup_only() -> None:
    rig = build_rig(SimDevice())
    _, host = backed_up(rig, node_id=1)
    refused(
        rig,
        lambda: rig.controller.evict_host(host, backup_only=False),
        HiCacheInputError,
        r"evict_host supports backup_only=True only",
    )


def test_evict_device_refuses_negative_indices() -> None:
    rig = build_rig(SimDevice())
    alloc(rig, PAGE)
    refused(
        rig,
        lambda: rig.controller.evict_device(torch.tensor([-1, 0, 1, 2])),
        HiCacheInputError,
        r"device_indices contains negative index -1",
    )


# -- layer ids -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_id", [-1, 3])
def test_submit_write_cp_layer_refuses_a_layer_outside_the_backup_range(layer_id: int) -> None:
    rig = cp_rig()
    reservation = reserve(rig, alloc(rig, 2 * PAGE), node_id=1)
    refused(
        rig,
        lambda: rig.controller.submit_write_cp_layer(reservation, layer_id),
        LayerRangeError,
        rf"layer_id={layer_id} is outside the CP backup layer range \[0, 3\) for node_id=1",
    )
    assert rig.controller.write_stream.query()  # nothing was issued


def test_refused_submit_write_cp_layer_leaves_no_pending_write() -> None:
    # reserve -> submit layer 3 of 3 -> refused -> the node is not left pending (INV-17)
    rig = cp_rig()
    reservation = reserve(rig, alloc(rig, 2 * PAGE), node_id=1)
    with pytest.raises(LayerRangeError):
        rig.controller.submit_write_cp_layer(reservation, 3)
    assert rig.controller.pending_layer_writes == {}
    # the caller rolls the reservation back: its host slots can be freed at once
    rig.controller.evict_cp_host(reservation.metadata)
    assert rig.host_pool.allocated_pages() == set()


def test_layer_end_hooks_refuse_a_layer_outside_the_pool() -> None:
    # early reservation pending -> hooks with bad layer ids -> typed errors, nothing submitted
    rig = cp_rig()
    c = rig.controller
    reservation = reserve(rig, alloc(rig, 2 * PAGE), node_id=1)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    refused(
        rig,
        lambda: rig.device_pool.notify_layer_end(3),
        LayerRangeError,
        r"layer_id 3 is outside \[start_layer, start_layer \+ layer_num\) = \[0, 3\)",
    )
    refused(
        rig,
        lambda: c.on_layer_end(7),
        LayerRangeError,
        r"layer_id=7 is outside the CP backup layer range \[0, 3\) for node_id=1",
    )
    refused(rig, lambda: c.on_layer_end(-1), LayerRangeError, r"layer_id=-1 is outside")
    refused(
        rig,
        lambda: c.on_layer_end(0, source="eagle"),
        HiCacheInputError,
        r"unknown layer backup source 'eagle'; legal values: target, draft",
    )
    assert c.pending_layer_writes[1].completed_target_layers == set()
    # the good hooks still complete the backup
    for layer in range(3):
        rig.device_pool.notify_layer_end(layer)
    assert ack_rows(c.ack_write_queue) == [[1]]


# -- construction ----------------------------------------------------------------------------------
CONSTRUCTION_ERRORS = [
    pytest.param(
        {"write_policy": "write_sometimes"},
        UnknownOptionError,
        r"unknown write_policy 'write_sometimes'; legal values: write_through, "
        r"write_through_selective, write_back, write_behind",
        id="write-policy",
    ),
    pytest.param(
        {"io_backend": "dma"},
        UnknownOptionError,
        r"unknown io_backend 'dma'; legal values: direct, kernel",
        id="io-backend",
    ),
    pytest.param(
        {"layout": "page_first", "io_backend": "direct"},
        UnknownOptionError,
        r"host layout 'page_first' cannot be used with io_backend 'direct'; "
        r"legal layouts for it: layer_first, page_first_direct",
        id="page_first-on-direct",
    ),
    pytest.param(
        {"layout": "page_first_direct", "io_backend": "kernel"},
        UnknownOptionError,
        r"host layout 'page_first_direct' cannot be used with io_backend 'kernel'; "
        r"legal layouts for it: layer_first, page_first",
        id="page_first_direct-on-kernel",
    ),
    pytest.param(
        {"storage_executor": "fork"},
        UnknownOptionError,
        r"unknown storage_executor 'fork'; legal values: thread, manual",
        id="storage-executor",
    ),
    pytest.param(
        {"page_size": 8},
        HiCacheInputError,
        r"page_size=8 must be >= 1 and equal the host pool's page_size=4",
        id="page-size",
    ),
    pytest.param(
        {"cp_shared_kv_layout": CpSharedKVLayout(2, 0, PAGE)},
        HiCacheInputError,
        r"CP shared KV HiCache requires an NSATokenToKVPool device pool, got MHATokenToKVPool",
        id="cp-on-mha",
    ),
    pytest.param(
        {"draft": "host"},
        DraftPoolPairError,
        r"draft_mem_pool_device and draft_mem_pool_host must be provided together "
        r"\(got device=False, host=True\)",
        id="draft-host-alone",
    ),
    pytest.param(
        {"draft": "device"},
        DraftPoolPairError,
        r"must be provided together \(got device=True, host=False\)",
        id="draft-device-alone",
    ),
]


def _construct(rig: Rig, options: dict[str, Any]) -> HiCacheController:
    """A controller over ``rig``'s pools with ``options`` overriding the defaults."""
    options = dict(options)
    host_pool = rig.host_pool
    if "layout" in options:
        host_pool = make_host_pool(rig.device_pool, layout=options.pop("layout"), size_tokens=64)
    draft = options.pop("draft", None)
    draft_device = make_device_pool("mha", rig.device, size_tokens=64, page_size=PAGE, layer_num=2)
    return HiCacheController(
        rig.allocator,
        host_pool,
        options.pop("page_size", PAGE),
        device_module=rig.device,
        draft_mem_pool_host=make_host_pool(draft_device, size_tokens=64)
        if draft == "host"
        else None,
        draft_mem_pool_device=draft_device if draft == "device" else None,
        **options,
    )


@pytest.mark.parametrize(("options", "error", "match"), CONSTRUCTION_ERRORS)
def test_construction_refuses_unknown_options_and_broken_pairs(
    options: dict[str, Any], error: type[BaseException], match: str
) -> None:
    rig = build_rig(SimDevice())
    with pytest.raises(error, match=match):
        _construct(rig, options)


@pytest.mark.parametrize(("options", "error", "match"), CONSTRUCTION_ERRORS)
def test_refused_construction_leaves_no_hook_on_the_device_pool(
    options: dict[str, Any], error: type[BaseException], match: str
) -> None:
    # a refused constructor must not leave a half-built controller wired into the pool
    rig = build_rig(SimDevice())
    rig.device_pool.layer_transfer_counter = None
    with pytest.raises(error):
        _construct(rig, options)
    assert rig.device_pool.layer_transfer_counter is None


def test_unknown_host_layout_is_refused_by_the_host_pool() -> None:
    device_pool = make_device_pool("mha", SimDevice(), size_tokens=64, page_size=PAGE, layer_num=3)
    with pytest.raises(
        UnknownOptionError,
        match=r"unknown host layout 'head_first'; legal layouts: layer_first, page_first, "
        r"page_first_direct",
    ):
        make_host_pool(device_pool, layout="head_first", size_tokens=64)


def test_attach_draft_pool_without_its_pair_is_refused_and_attaches_nothing() -> None:
    rig = build_rig(SimDevice())
    draft_device = make_device_pool("mha", rig.device, size_tokens=64, page_size=PAGE, layer_num=2)
    with pytest.raises(DraftPoolPairError, match=r"\(got device=True, host=False\)"):
        rig.controller.attach_draft_pool(draft_device, None)
    assert not rig.controller.has_draft
    assert draft_device.layer_transfer_counter is None


# -- double and foreign frees (INV-05) ---------------------------------------------------------------
def test_evict_host_twice_is_a_double_free() -> None:
    # n1 backed up -> evict_host -> evict_host again -> refused, nothing changes
    rig = build_rig(SimDevice())
    _, host = backed_up(rig, node_id=1)
    rig.controller.evict_host(host)
    refused(
        rig,
        lambda: rig.controller.evict_host(host),
        DoubleFreeError,
        r"INV-05: host free got page \d+ \(slots \d+\.\.\d+\), which is free already",
    )


def test_evict_host_of_a_held_and_a_free_page_frees_neither() -> None:
    rig = build_rig(SimDevice())
    _, host1 = backed_up(rig, node_id=1)
    _, host2 = backed_up(rig, node_id=2)
    rig.controller.evict_host(host1)
    refused(
        rig,
        lambda: rig.controller.evict_host(torch.cat([host2, host1])),
        DoubleFreeError,
        r"which is free already",
    )


def test_evict_device_twice_is_a_double_free() -> None:
    rig = build_rig(SimDevice())
    locs, _ = backed_up(rig, node_id=1)
    rig.controller.evict_device(locs)
    refused(
        rig,
        lambda: rig.controller.evict_device(locs),
        DoubleFreeError,
        r"INV-05: free\(\) got page \d+ .*which is free already",
    )


@pytest.mark.parametrize(
    ("verb", "indices", "match"),
    [
        (
            "evict_host",
            torch.arange(64, 68),
            r"INV-05: host free got page 16 .* outside this "
            r"pool's pages \[0, 16\)",
        ),
        ("evict_device", torch.arange(0, 4), r"INV-05: free\(\) got page 0 .* page 0 is reserved"),
        (
            "evict_device",
            torch.arange(68, 72),
            r"INV-05: free\(\) got page 17, outside this "
            r"allocator's pages \[1, 16\]",
        ),
    ],
)
def test_foreign_slots_are_refused(verb: str, indices: torch.Tensor, match: str) -> None:
    rig = build_rig(SimDevice())
    backed_up(rig, node_id=1)
    refused(rig, lambda: getattr(rig.controller, verb)(indices), ForeignSlotError, match)


# -- CP metadata -----------------------------------------------------------------------------------
def test_load_cp_of_a_node_without_cp_metadata_is_refused() -> None:
    rig = cp_rig()
    refused(
        rig,
        lambda: rig.controller.load_cp([CpNodeView(5, 4, None)], node_id=5),
        MissingCpMetadataError,
        r"load_cp called with node 5 that has no cp_hicache metadata",
    )


def test_load_cp_with_a_draft_pool_needs_draft_host_indices() -> None:
    # n1 backed up without a draft -> a draft pool is attached -> load_cp(n1) refused
    rig = cp_rig()
    c = rig.controller
    reservation = reserve(rig, alloc(rig, 2 * PAGE), node_id=1)
    c.submit_write_cp_per_layer(reservation)
    sim_of(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    draft_device = make_device_pool("nsa", rig.device, size_tokens=64, page_size=PAGE, layer_num=2)
    c.attach_draft_pool(draft_device, make_host_pool(draft_device, size_tokens=64))
    view = CpNodeView(1, 2 * PAGE, reservation.metadata)
    refused(
        rig,
        lambda: c.load_cp([view], node_id=1),
        MissingCpMetadataError,
        r"node 1: a draft pool is attached but the node's metadata has no draft_host_indices",
    )
    refused(
        rig,
        lambda: c.evict_cp_host(reservation.metadata),
        MissingCpMetadataError,
        r"a draft pool is attached but the metadata has no draft_host_indices",
    )


def test_load_cp_refuses_a_host_len_that_disagrees_with_the_metadata() -> None:
    rig = cp_rig()
    c = rig.controller
    reservation = reserve(rig, alloc(rig, PAGE), node_id=1)
    c.submit_write_cp_per_layer(reservation)
    sim_of(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    refused(
        rig,
        lambda: c.load_cp([CpNodeView(1, 5, reservation.metadata)], node_id=1),
        HiCacheInputError,
        r"node 1: host_len=5 differs from the CP metadata valid_len=4",
    )


def test_cp_verbs_on_a_controller_without_cp_are_refused() -> None:
    rig = build_rig(SimDevice())
    c = rig.controller
    refused(
        rig,
        lambda: c.reserve_write_cp(_alloc_free(rig), node_id=1),
        HiCacheInputError,
        r"this controller has no cp_shared_kv_layout",
    )
    refused(
        rig,
        lambda: c.load_cp([CpNodeView(1, 4, None)]),
        HiCacheInputError,
        r"load_cp needs a controller built with cp_shared_kv_layout",
    )


def test_plain_load_on_a_cp_controller_is_refused() -> None:
    # CP ranks hold physical pages: load() would H2D into logical locs without owner replay
    # (INV-03); load_cp is the verb
    rig = build_rig(
        SimDevice(), kind="nsa", cp_layout=CpSharedKVLayout(2, 1, PAGE), device_pages=16
    )
    host = rig.host_pool.alloc(2 * PAGE)
    assert host is not None
    refused(
        rig,
        lambda: rig.controller.load(host, node_id=1),
        HiCacheInputError,
        r"load_cp",
    )


def _alloc_free(rig: Rig) -> torch.Tensor:
    """Locs of a page that is free (nothing is allocated for them)."""
    page = rig.allocator.free_page_ids()[0]
    return torch.arange(page * PAGE, page * PAGE + PAGE)


def test_evict_cp_host_without_metadata_is_refused() -> None:
    rig = cp_rig()
    refused(
        rig,
        lambda: rig.controller.evict_cp_host(None),
        MissingCpMetadataError,
        r"evict_cp_host needs the node's cp_hicache metadata",
    )


# -- capacity shortfalls are values (INV-17) ---------------------------------------------------------
def test_write_with_a_full_host_returns_none_and_changes_nothing() -> None:
    rig = build_rig(SimDevice(), host_pages=2)
    backed_up(rig, node_id=1)  # takes both host pages
    locs = alloc(rig, PAGE)
    before = snapshot(rig)
    assert rig.controller.write(locs, node_id=2) is None
    assert snapshot(rig) == before


def test_load_with_a_full_device_returns_none_and_changes_nothing() -> None:
    rig = build_rig(SimDevice(), device_pages=2)
    _, host = backed_up(rig, node_id=1)  # takes both device pages
    before = snapshot(rig)
    assert rig.controller.load(host, node_id=1) is None
    assert snapshot(rig) == before


def test_reserve_write_cp_with_a_full_host_is_a_host_capacity_failure() -> None:
    rig = cp_rig(host_pages=1, draft_layer_num=2)
    locs = alloc(rig, 2 * PAGE)
    before = snapshot(rig)
    failure = rig.controller.reserve_write_cp(locs, node_id=1)
    assert failure == HiCacheWriteFailure(required_host_slots=2 * PAGE, reason="host_capacity")
    assert snapshot(rig) == before


def test_reserve_write_cp_short_on_the_draft_host_returns_the_target_slots() -> None:
    # target host has room, the draft host has one page -> draft_host_capacity, nothing held
    rig = cp_rig(draft_layer_num=2, draft_host_pages=1)
    locs = alloc(rig, 2 * PAGE)
    before = snapshot(rig)
    failure = rig.controller.reserve_write_cp(locs, node_id=1)
    assert failure == HiCacheWriteFailure(
        required_host_slots=2 * PAGE, reason="draft_host_capacity"
    )
    assert snapshot(rig) == before
    assert rig.host_pool.allocated_pages() == set()


def test_load_cp_without_pages_of_the_recorded_owners_returns_none() -> None:
    rig = cp_rig(device_pages=4)
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    reservation = reserve(rig, locs, node_id=1)
    c.submit_write_cp_per_layer(reservation)
    sim_of(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    alloc(rig, 2 * PAGE)  # the device is full now
    before = snapshot(rig)
    assert c.load_cp([CpNodeView(1, 2 * PAGE, reservation.metadata)], node_id=1) is None
    assert snapshot(rig) == before


# -- F19: hooks only after everything that can fail ---------------------------------------------------
def _broken_backend(*_: object) -> Any:
    raise RuntimeError("the storage service is unreachable")


@pytest.mark.parametrize(
    ("backend", "error", "match"),
    [
        pytest.param(
            "no-such-backend",
            UnknownOptionError,
            r"Failed to create storage backend: unknown storage backend 'no-such-backend'",
            id="unknown-backend",
        ),
        pytest.param(
            "f19-broken", RuntimeError, r"the storage service is unreachable", id="attach-raises"
        ),
    ],
)
def test_a_constructor_whose_storage_attach_fails_leaves_no_hook_on_the_pools(
    backend: str, error: type[BaseException], match: str
) -> None:
    # storage attach fails after every option was accepted -> no counter, no layer-end hook
    # on the target or the draft pool: the half-built controller is not wired in (F19)
    from hicache_ref.storage.factory import StorageBackendFactory

    rig = build_rig(SimDevice())
    draft_device = make_device_pool("mha", rig.device, size_tokens=64, page_size=PAGE, layer_num=2)
    pools = (rig.device_pool, draft_device)
    for pool in pools:
        pool.layer_transfer_counter = None
    hooks_before = [list(pool._backup_notifiers) for pool in pools]
    StorageBackendFactory.register_backend("f19-broken", _broken_backend, replace=True)
    try:
        with pytest.raises(error, match=match):
            HiCacheController(
                rig.allocator,
                rig.host_pool,
                PAGE,
                device_module=rig.device,
                draft_mem_pool_device=draft_device,
                draft_mem_pool_host=make_host_pool(draft_device, size_tokens=64),
                storage_backend=backend,
                storage_executor="manual",
            )
    finally:
        StorageBackendFactory.unregister_backend("f19-broken")
    assert [pool.layer_transfer_counter for pool in pools] == [None, None]
    assert [list(pool._backup_notifiers) for pool in pools] == hooks_before
    rig.device_pool.notify_layer_end(0)  # reaches only the rig's own controller


def test_a_constructor_with_storage_registers_its_hooks_once_it_succeeded() -> None:
    rig = build_rig(SimDevice())
    hooks = len(rig.device_pool._backup_notifiers)
    c = HiCacheController(
        rig.allocator,
        rig.host_pool,
        PAGE,
        device_module=rig.device,
        storage_backend="memory",
        storage_executor="manual",
    )
    assert rig.device_pool.layer_transfer_counter is c.layer_done_counter
    assert len(rig.device_pool._backup_notifiers) == hooks + 1
    c.detach_storage_backend()
