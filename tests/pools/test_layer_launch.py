"""A per-layer transfer is checked once per index pair, and never served stale (``layer_launch``).

The host pool keeps each pair's prepared transfer, so a batch's later layers skip the checks;
these stories change what the checks saw between two layers (the tensors in place, another
tensor of the same shape, the copy path, a cleared pool, a layer outside the pool) and show the
next layer checked and planned again: it moves the new rows, or it is refused with the error a
fresh transfer gets.
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import (
    HiCacheInputError,
    IndexOutsidePoolError,
    LayerOutsidePoolError,
    UnknownOptionError,
)
from hicache_ref.pools import HostKVCache, KVCache
from hicache_ref.pools.triton_copy import TritonLaunch, is_triton_available

from .builders import SENTINEL, fill_with_sentinel, make_pools, pages_to_locs, row_values

NEEDS_TRITON = pytest.mark.skipif(
    not is_triton_available(), reason="needs the triton package (its CPU interpreter)"
)
PATHS = ("gather", "runs", "batch", pytest.param("triton", marks=NEEDS_TRITON))
PAGE = 4


def loaded_world(
    copy_path: str, layout: str = "layer_first"
) -> tuple[SimDevice, KVCache, HostKVCache]:
    """Pools of 3 layers, the device all ``SENTINEL``, every host row distinctive."""
    sim = SimDevice()
    device_pool, host_pool = make_pools(
        "mha", sim, page_size=PAGE, layout=layout, copy_path=copy_path
    )
    fill_with_sentinel(device_pool, host_pool)
    slots = torch.arange(host_pool.size)
    for name in host_pool.component_names():
        for layer in range(host_pool.layer_num):
            host_pool.write_rows(name, layer, slots, row_values(device_pool, name, layer, slots, 1))
    return sim, device_pool, host_pool


def assert_layer_landed(
    device_pool: KVCache, host_pool: HostKVCache, layer: int, host: torch.Tensor, locs: torch.Tensor
) -> None:
    for name in device_pool.component_names():
        assert torch.equal(
            device_pool.read_rows(name, layer, locs), host_pool.read_rows(name, layer, host)
        ), (name, layer)


def assert_layer_untouched(device_pool: KVCache, layer: int, locs: torch.Tensor) -> None:
    for name in device_pool.component_names():
        assert device_pool.read_rows(name, layer, locs).eq(SENTINEL).all(), (name, layer)


@pytest.mark.parametrize("copy_path", PATHS)
def test_device_indices_rewritten_in_place_between_layers_load_the_new_locs(
    copy_path: str,
) -> None:
    sim, device_pool, host_pool = loaded_world(copy_path)
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    old_locs = device.clone()
    # layer 0 of the pair -> prepared, landed at pages 1 and 3
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    sim.run_until_idle()
    # the caller rewrites the same tensor in place to pages 4 and 6 -> layer 1 lands there
    device.copy_(pages_to_locs([4, 6], PAGE))
    host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    sim.run_until_idle()
    assert_layer_landed(device_pool, host_pool, 0, host, old_locs)
    assert_layer_landed(device_pool, host_pool, 1, host, device)
    assert_layer_untouched(device_pool, 1, old_locs)
    assert host_pool.layer_launches.prepared_pairs == 2


@pytest.mark.parametrize("copy_path", PATHS)
def test_an_index_rewritten_past_the_pool_between_layers_is_refused(copy_path: str) -> None:
    sim, device_pool, host_pool = loaded_world(copy_path)
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    sim.run_until_idle()
    # device[0] now names a row the pool does not have -> layer 1 refused, nothing queued
    device[0] = 10_000
    with pytest.raises(IndexOutsidePoolError, match=r"INV-05: device_indices\[0\]=10000"):
        host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    assert sim.pending_ops() == 0


@pytest.mark.parametrize("copy_path", PATHS)
def test_another_tensor_of_the_same_shape_is_checked_as_its_own_pair(copy_path: str) -> None:
    sim, device_pool, host_pool = loaded_world(copy_path)
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    # same shape, same dtype, other values: its own rows, never the first pair's plan
    other = pages_to_locs([5, 7], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, other, 0, "kernel")
    sim.run_until_idle()
    assert_layer_landed(device_pool, host_pool, 0, host, device)
    assert_layer_landed(device_pool, host_pool, 0, host, other)
    # and one with a negative index is refused, however alike it looks
    negative = pages_to_locs([5, 7], PAGE)
    negative[3] = -1
    with pytest.raises(HiCacheInputError, match=r"device_indices\[3\]=-1 is negative"):
        host_pool.load_to_device_per_layer(device_pool, host, negative, 1, "kernel")


def test_setting_the_copy_path_between_layers_checks_the_new_path() -> None:
    sim, device_pool, host_pool = loaded_world("gather", layout="page_first")
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    # gather -> batch, which cannot move page_first: layer 1 of the same pair is refused
    host_pool.copy_path = "batch"
    with pytest.raises(HiCacheInputError, match=r"copy_path='batch' cannot drive host layout"):
        host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    # back to gather: layer 1 loads
    host_pool.copy_path = "gather"
    host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    sim.run_until_idle()
    assert_layer_landed(device_pool, host_pool, 1, host, device)
    # a new Triton launch shape drops the pair too (its kernels were built for the old one)
    assert len(host_pool.layer_launches) == 1
    host_pool.triton_launch = TritonLaunch(grid=4)
    assert len(host_pool.layer_launches) == 0


def test_clearing_the_host_pool_forgets_its_prepared_pairs() -> None:
    sim, device_pool, host_pool = loaded_world("batch")
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    assert len(host_pool.layer_launches) == 1
    # reset -> nothing kept; the next layer prepares the pair again
    host_pool.clear()
    assert len(host_pool.layer_launches) == 0
    host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    sim.run_until_idle()
    assert host_pool.layer_launches.prepared_pairs == 2
    assert_layer_landed(device_pool, host_pool, 1, host, device)


@pytest.mark.parametrize("layer_id", [3, -1])
def test_a_layer_outside_the_pool_is_refused_after_its_pair_was_prepared(layer_id: int) -> None:
    sim, device_pool, host_pool = loaded_world("batch")
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    with pytest.raises(
        LayerOutsidePoolError, match=rf"^INV-06: a transfer addressed layer_id {layer_id}"
    ):
        host_pool.load_to_device_per_layer(device_pool, host, device, layer_id, "kernel")
    with pytest.raises(LayerOutsidePoolError, match=r"^INV-06"):
        host_pool.backup_from_device_per_layer(device_pool, host, device, layer_id, "kernel")
    sim.run_until_idle()


@pytest.mark.parametrize("copy_path", PATHS)
def test_inference_mode_indices_are_checked_on_every_layer(copy_path: str) -> None:
    sim, device_pool, host_pool = loaded_world(copy_path)
    with torch.inference_mode():  # no version counter: such a pair is never kept
        host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
        host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
        sim.run_until_idle()
        device[0] = -5
        with pytest.raises(HiCacheInputError, match=r"device_indices\[0\]=-5 is negative"):
            host_pool.load_to_device_per_layer(device_pool, host, device, 1, "kernel")
    assert host_pool.layer_launches.prepared_pairs == 0
    assert_layer_landed(device_pool, host_pool, 0, host, pages_to_locs([1, 3], PAGE))


@pytest.mark.parametrize("copy_path", PATHS)
def test_per_layer_backups_of_one_pair_each_write_their_own_layer(copy_path: str) -> None:
    sim, device_pool, host_pool = loaded_world(copy_path)
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    for layer in range(device_pool.layer_num):  # load, then back up into other host slots
        host_pool.load_to_device_per_layer(device_pool, host, device, layer, "kernel")
    backup_host = pages_to_locs([9, 11], PAGE)
    for layer in reversed(range(device_pool.layer_num)):
        host_pool.backup_from_device_per_layer(device_pool, backup_host, device, layer, "kernel")
    sim.run_until_idle()
    for layer in range(device_pool.layer_num):
        for name in device_pool.component_names():
            assert torch.equal(
                host_pool.read_rows(name, layer, backup_host),
                host_pool.read_rows(name, layer, host),
            )
    assert host_pool.layer_launches.prepared_pairs == 2  # one load pair, one backup pair


def test_a_misspelled_io_backend_is_refused_naming_the_legal_ones_after_a_prepared_pair() -> None:
    sim, device_pool, host_pool = loaded_world("batch")
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    host_pool.load_to_device_per_layer(device_pool, host, device, 0, "kernel")
    # the pair is kept for "kernel"; another backend (or an unhashable one) is checked anew
    for io_backend in ("kernal", ["kernel"]):
        with pytest.raises(UnknownOptionError, match=r"legal values: direct, kernel"):
            host_pool.load_to_device_per_layer(device_pool, host, device, 1, io_backend)  # type: ignore[arg-type]
    sim.run_until_idle()


@pytest.mark.parametrize("copy_path", PATHS)
def test_layers_in_one_call_queue_each_layer_then_its_callback_on_the_simulator(
    copy_path: str,
) -> None:
    # the simulator queues each launch, so the layers go one launch each, the callback's event
    # queued right behind its layer: the stream order of a per-layer loop
    sim, device_pool, host_pool = loaded_world(copy_path)
    host, device = pages_to_locs([2, 0], PAGE), pages_to_locs([1, 3], PAGE)
    events = [sim.Event() for _ in range(device_pool.layer_num)]

    def after_layer(layer: int) -> None:
        events[layer].record()

    host_pool.load_to_device_layers(
        device_pool, host, device, range(device_pool.layer_num), "kernel", after_layer
    )
    sim.run_until_idle()
    labels = [op.label for op in sim.log]
    assert len(labels) == 2 * device_pool.layer_num
    assert [("layer" in label) for label in labels] == [True, False] * device_pool.layer_num
    for layer in range(device_pool.layer_num):
        assert_layer_landed(device_pool, host_pool, layer, host, device)
    # a layer outside the pool is refused before anything is queued (INV-06)
    with pytest.raises(LayerOutsidePoolError, match="INV-06"):
        host_pool.load_to_device_layers(
            device_pool, host, device, [0, device_pool.layer_num], "kernel", after_layer
        )
    assert sim.pending_ops() == 0
