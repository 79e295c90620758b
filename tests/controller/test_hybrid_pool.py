"""A hybrid (full + linear attention) model: the controller caches the full-attention layers only.

The allocator hands the controller a ``HybridLinearKVPool``; the controller unwraps it to
``full_kv_pool`` (as upstream does) before it reads ``layer_num`` and registers its hooks, so
every transfer, every per-layer load event and every layer-end backup speaks full-attention ids.
The stories: the plain round trip over every pool kind and legal (io_backend, layout) pair, with
a draft pool, under CP with early reservations driven by the hybrid pool's own layer-end hook,
and the forward reading a model layer waits on the load event of its full-attention id.
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import CudaDevice, SimDevice, cuda_available
from hicache_ref.invariants.models import HiCacheWriteReservation
from hicache_ref.pools import HybridLinearKVPool, make_host_pool

from .rig import (
    LEGAL_PAIRS,
    POOL_KINDS,
    TARGET_LAYERS,
    Rig,
    ack_rows,
    assert_rows,
    build_cp_rigs,
    build_rig,
    drain_acks,
    fill_node,
    hybrid_layer_ids,
    make_device_pool,
    run_first,
    zero_device_pool,
)
from .round_trips import (
    HeldWriteController,
    assert_cp_round_trip,
    assert_write_evict_load_round_trip,
)

LINEAR_MARK = 7.25


def hybrid_of(rig: Rig) -> HybridLinearKVPool:
    assert rig.hybrid_pool is not None
    return rig.hybrid_pool


def mark_linear_state(pool: HybridLinearKVPool) -> None:
    for layer_id in pool.linear_attention_layer_ids:
        pool.get_linear_state(layer_id).fill_(LINEAR_MARK + layer_id)


def assert_linear_state_untouched(pool: HybridLinearKVPool) -> None:
    # HiCache never caches linear-attention state: no transfer may touch it
    for layer_id in pool.linear_attention_layer_ids:
        state = pool.get_linear_state(layer_id)
        assert bool((state == LINEAR_MARK + layer_id).all()), f"linear layer {layer_id} changed"


def test_the_controller_unwraps_the_hybrid_pool_before_hooking_and_counting_layers() -> None:
    rig = build_rig(SimDevice(), hybrid=True)
    pool, c = hybrid_of(rig), rig.controller
    assert rig.allocator.get_kvcache() is pool
    assert c.mem_pool_device is pool.full_kv_pool is rig.device_pool
    assert c.layer_num == TARGET_LAYERS  # full-attention layers, not the model's 2x
    assert c.layer_done_counter.num_layers == TARGET_LAYERS
    assert rig.device_pool.layer_transfer_counter is c.layer_done_counter


@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize(("io_backend", "layout"), LEGAL_PAIRS)
def test_a_hybrid_pool_round_trips_its_full_attention_layers(
    io_backend: str, layout: str, kind: str
) -> None:
    rig = build_rig(
        SimDevice(seed=3),
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        hybrid=True,
        controller_class=HeldWriteController,
    )
    mark_linear_state(hybrid_of(rig))
    # write -> ack -> evict -> load -> start_loading -> bytes equal on the full pool
    assert_write_evict_load_round_trip(rig, merged=True)
    assert_linear_state_untouched(hybrid_of(rig))


@pytest.mark.parametrize("draft_layer_num", [TARGET_LAYERS - 2, TARGET_LAYERS + 2])
def test_a_hybrid_target_round_trips_with_a_draft_pool(draft_layer_num: int) -> None:
    rig = build_rig(
        SimDevice(seed=4),
        hybrid=True,
        draft_layer_num=draft_layer_num,
        controller_class=HeldWriteController,
    )
    assert rig.controller.draft_layer_num == draft_layer_num
    assert_write_evict_load_round_trip(rig, merged=True)


def test_a_hybrid_draft_pool_is_unwrapped_too() -> None:
    rig = build_rig(SimDevice(seed=5), hybrid=True, controller_class=HeldWriteController)
    draft_full = make_device_pool("mha", rig.device, size_tokens=64, page_size=4, layer_num=2)
    draft = HybridLinearKVPool(draft_full, *hybrid_layer_ids(2))
    draft_host = make_host_pool(draft_full, size_tokens=64)
    rig.controller.attach_draft_pool(draft, draft_host)
    assert rig.controller.draft_mem_pool_device is draft_full
    assert rig.controller.draft_layer_num == 2
    assert draft_full.layer_transfer_counter is not None
    rig.draft_device_pool, rig.draft_host_pool = draft_full, draft_host
    assert_write_evict_load_round_trip(rig, merged=True)


@pytest.mark.parametrize("path", ["write", "catch_up", "all_layer", "early_reservation"])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_hybrid_nsa_pools_round_trip_under_cp(cp_size: int, path: str) -> None:
    rigs = build_cp_rigs(
        SimDevice(seed=cp_size), cp_size, page_size=4, device_pages=32, hybrid=True
    )
    for rig in rigs:
        mark_linear_state(hybrid_of(rig))
    assert_cp_round_trip(rigs, path=path)
    for rig in rigs:
        assert_linear_state_untouched(hybrid_of(rig))


def test_the_hybrid_pools_layer_end_hook_drives_the_per_layer_backup() -> None:
    # reserve early -> the forward stores each model layer and calls the hybrid pool's
    # notify_layer_end(model id) -> full layers back up, linear ones are skipped -> one ack
    rig = build_cp_rigs(SimDevice(), 1, page_size=4, device_pages=32, hybrid=True)[0]
    pool, c = hybrid_of(rig), rig.controller
    locs = rig.allocator.alloc(8)
    assert locs is not None
    reservation = c.reserve_write_cp(locs, node_id=1)
    assert isinstance(reservation, HiCacheWriteReservation)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    full_ids = pool.full_attention_layer_id_mapping
    for model_layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        if model_layer in full_ids:
            layer = full_ids[model_layer]
            _store_layer(rig, locs, uid=1, layer=layer)
        pool.notify_layer_end(model_layer)
        if model_layer != max(full_ids):
            assert not c.ack_write_queue  # not before the last full-attention layer
    assert ack_rows(c.ack_write_queue) == [[1]]
    assert isinstance(rig.device, SimDevice)
    rig.device.run_until_idle()
    assert drain_acks(c.ack_write_queue) == [[1]]
    assert_rows(rig.host_pool, reservation.host_indices, rig.device_pool, 1, where="host n1")


def _store_layer(rig: Rig, locs: torch.Tensor, *, uid: int, layer: int) -> None:
    layout = rig.cp_layout
    assert layout is not None
    physical = layout.logical_locs_to_physical(locs)
    rig.device.launch(
        lambda: fill_node(rig.device_pool, physical, uid, layers=range(layer, layer + 1)),
        label=f"store n{uid} L{layer}",
        kind="kernel",
    )


def test_the_forward_reading_a_model_layer_waits_for_its_full_attention_load() -> None:
    # load n1 -> start_loading -> the forward reads model layer 3 (full-attention layer 1)
    # -> its read waits for layer 1's H2D, so it sees the loaded bytes, never the stale ones
    rig = build_rig(SimDevice(), hybrid=True, controller_class=HeldWriteController)
    pool, c, device = hybrid_of(rig), rig.controller, rig.device
    assert isinstance(device, SimDevice)
    locs = rig.allocator.alloc(4)
    assert locs is not None
    fill_node(rig.device_pool, locs, 1)
    host = c.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    device.run_until_idle()
    drain_acks(c.ack_write_queue)
    c.evict_device(locs)
    zero_device_pool(rig.device_pool)
    new = c.load(host, node_id=1)
    assert new is not None
    producer = c.start_loading()
    c.layer_done_counter.set_consumer(producer)
    seen: list[torch.Tensor] = []
    buffer = pool.get_key_buffer(3)  # queues the forward stream's wait on layer 1's event
    device.launch(lambda: seen.append(buffer[new].clone()), label="forward read L3", kind="kernel")
    # adversarial schedule: the forward stream runs whenever it is not blocked
    run_first(device, device.default_stream)
    expected = rig.device_pool.read_rows("k", 1, new)
    assert torch.equal(seen[0], expected) and bool((expected != 0).all())


# -- the same on a GPU ---------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize(("io_backend", "layout"), LEGAL_PAIRS)
def test_a_hybrid_pool_round_trips_on_the_gpu(io_backend: str, layout: str, kind: str) -> None:
    device = CudaDevice()
    rig = build_rig(
        device,
        kind=kind,
        layout=layout,
        io_backend=io_backend,
        hybrid=True,
        draft_layer_num=TARGET_LAYERS + 2,
        controller_class=HeldWriteController,
    )
    mark_linear_state(hybrid_of(rig))
    assert_write_evict_load_round_trip(rig, merged=True)
    device.synchronize()
    assert_linear_state_untouched(hybrid_of(rig))
