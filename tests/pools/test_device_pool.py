"""Device KV pools: geometry per kind, the layer wait before forward reads (INV-11), the
per-layer backup notifiers (INV-12) and layer-range errors."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, LayerRangeError
from hicache_ref.pools import MHATokenToKVPool, MLATokenToKVPool, NSATokenToKVPool

from .builders import POOL_KINDS, make_device_pool


class RecordingCounter:
    """A LayerTransferCounter that records which local layers were waited for."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_until(self, threshold: int) -> None:
        self.waited.append(threshold)


@pytest.mark.parametrize(
    ("kind", "components", "row_shapes"),
    [
        ("mha", ("k", "v"), [(2, 3), (2, 3)]),
        ("mla", ("kv",), [(1, 5)]),
        ("nsa", ("kv", "index_k"), [(1, 5), (1, 4)]),
    ],
)
def test_pool_kinds_have_their_components_and_a_padding_page(
    kind: str, components: tuple[str, ...], row_shapes: list[tuple[int, ...]]
) -> None:
    sim = SimDevice()
    pool = make_device_pool(kind, sim, size=32, page_size=4, layer_num=3)
    assert pool.component_names() == components
    assert pool.device == sim.device and pool.device_module is sim
    for layer_id in range(3):
        buffers = pool.layer_buffers(layer_id)
        assert [tuple(b.shape) for b in buffers] == [(36, *shape) for shape in row_shapes]
        assert all(b.dtype == torch.float32 and not b.any() for b in buffers)


def test_layer_buffers_of_different_layers_are_distinct_tensors() -> None:
    pool = make_device_pool("mha", SimDevice())
    pool.layer_buffers(0)[0].fill_(1.0)
    assert not pool.layer_buffers(1)[0].any()


def test_get_buffer_waits_for_the_local_layer_and_layer_buffers_does_not() -> None:
    # a PP stage holding model layers 2..4: reading model layer 3 waits for local layer 1
    pool = make_device_pool("mha", SimDevice(), layer_num=3, start_layer=2)
    counter = RecordingCounter()
    pool.register_layer_transfer_counter(counter)
    pool.layer_buffers(1)
    assert counter.waited == []
    assert pool.get_key_buffer(3) is pool.layer_buffers(1)[0]
    assert pool.get_value_buffer(4) is pool.layer_buffers(2)[1]
    assert counter.waited == [1, 2]


def test_get_buffer_without_a_counter_does_not_wait() -> None:
    pool = make_device_pool("mla", SimDevice())
    assert pool.get_key_buffer(0) is pool.layer_buffers(0)[0]


def test_mla_value_buffer_is_the_latent_part_of_kv() -> None:
    pool = make_device_pool("mla", SimDevice())
    assert isinstance(pool, MLATokenToKVPool)
    key, value = pool.get_kv_buffer(1)
    assert value.shape[-1] == pool.kv_lora_rank
    value.fill_(2.0)
    assert bool((key[..., : pool.kv_lora_rank] == 2.0).all())
    assert not key[..., pool.kv_lora_rank :].any()


def test_nsa_index_buffer_waits_too() -> None:
    pool = make_device_pool("nsa", SimDevice())
    assert isinstance(pool, NSATokenToKVPool)
    counter = RecordingCounter()
    pool.register_layer_transfer_counter(counter)
    assert pool.get_index_k_buffer(2) is pool.index_k_buffer[2]
    assert counter.waited == [2]


def test_notify_layer_end_calls_every_notifier_with_the_local_layer() -> None:
    pool = make_device_pool("nsa", SimDevice(), layer_num=2, start_layer=5)
    target: list[int] = []
    draft: list[int] = []
    pool.register_layer_backup_notifier(target.append)
    pool.register_layer_backup_notifier(draft.append)
    pool.notify_layer_end(5)
    pool.notify_layer_end(6)
    assert target == [0, 1] and draft == [0, 1]


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_layer_ids_out_of_range_are_refused(kind: str) -> None:
    pool = make_device_pool(kind, SimDevice(), layer_num=4)
    with pytest.raises(LayerRangeError, match=r"layer_id 4 is outside \[0, layer_num\) = \[0, 4\)"):
        pool.layer_buffers(4)
    with pytest.raises(LayerRangeError, match=r"\[0, 4\)"):
        pool.get_key_buffer(-1)
    with pytest.raises(LayerRangeError, match=r"\[0, 4\)"):
        pool.notify_layer_end(7)


def test_model_layer_range_names_start_layer() -> None:
    pool = make_device_pool("mha", SimDevice(), layer_num=2, start_layer=4)
    with pytest.raises(
        LayerRangeError, match=r"\[start_layer, start_layer \+ layer_num\) = \[4, 6\)"
    ):
        pool.get_key_buffer(1)


def test_rows_round_trip_through_the_harness_helpers() -> None:
    pool = make_device_pool("mha", SimDevice())
    locs = torch.tensor([5, 9])
    values = torch.arange(12, dtype=torch.float32).view(2, 2, 3)
    pool.write_rows("v", 2, locs, values)
    assert torch.equal(pool.read_rows("v", 2, locs), values)
    assert not pool.read_rows("k", 2, locs).any()
    with pytest.raises(
        HiCacheInputError, match=r"unknown component 'q'; this pool has \('k', 'v'\)"
    ):
        pool.read_rows("q", 0, locs)


def test_bad_geometry_is_refused() -> None:
    sim = SimDevice()
    with pytest.raises(HiCacheInputError, match="page_size must be >= 1"):
        MHATokenToKVPool(8, 0, torch.float32, 1, 1, 1, sim)
    with pytest.raises(HiCacheInputError, match="layer_num must be >= 1"):
        MHATokenToKVPool(8, 4, torch.float32, 1, 1, 0, sim)
    with pytest.raises(HiCacheInputError, match="positive row shape"):
        MHATokenToKVPool(8, 4, torch.float32, 0, 1, 1, sim)


def test_size_per_token_counts_every_layer_and_component() -> None:
    pool = make_device_pool("nsa", SimDevice(), layer_num=3)
    assert pool.get_size_per_token() == (5 + 4) * 4 * 3
