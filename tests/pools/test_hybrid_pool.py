"""HybridLinearKVPool: full-attention KV in ``full_kv_pool``, linear state that is never cached.

The forward addresses the hybrid pool by model layer id; every full-attention layer maps to its
full-attention id in ``full_kv_pool`` (where the controller's hooks live), a linear layer has no
KV buffer and no backup, and the token-indexed surface refuses, naming ``full_kv_pool``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.errors import HiCacheInputError, LayerRangeError
from hicache_ref.pools import (
    HybridLinearKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
    interleaved_layer_ids,
    unwrap_full_kv_pool,
)

PAGE = 4


def full_pool(layer_num: int = 2, kind: str = "mha") -> MHATokenToKVPool | MLATokenToKVPool:
    device = SimDevice()
    if kind == "mla":
        return MLATokenToKVPool(32, PAGE, torch.float64, 3, 1, layer_num, device)
    if kind == "nsa":
        return NSATokenToKVPool(32, PAGE, torch.float64, 3, 1, layer_num, device, index_head_dim=2)
    return MHATokenToKVPool(32, PAGE, torch.float64, 2, 2, layer_num, device)


def hybrid(kind: str = "mha") -> HybridLinearKVPool:
    # model layers 0..3: 0 and 2 linear, 1 and 3 full attention (ids 0 and 1 of full_kv_pool)
    return HybridLinearKVPool(full_pool(2, kind), [1, 3], [0, 2])


class Recorder:
    def __init__(self) -> None:
        self.waits: list[int] = []

    def wait_until(self, threshold: int) -> None:
        self.waits.append(threshold)


@pytest.mark.parametrize("kind", ["mha", "mla", "nsa"])
def test_the_hybrid_pool_mirrors_its_full_pool_geometry(kind: str) -> None:
    pool = hybrid(kind)
    full = pool.full_kv_pool
    assert unwrap_full_kv_pool(pool) is full
    assert unwrap_full_kv_pool(full) is full
    assert pool.full_attention_layer_id_mapping == {1: 0, 3: 1}
    assert pool.full_layer_nums == full.layer_num == 2
    assert (pool.start_layer, pool.layer_num) == (0, 4)
    assert (pool.size, pool.page_size, pool.dtype) == (full.size, full.page_size, full.dtype)
    assert pool.component_names() == full.component_names()
    assert pool.get_size_per_token() == full.get_size_per_token()


def test_buffers_of_a_model_layer_are_the_full_pools_buffers_of_its_full_id() -> None:
    pool = hybrid()
    full = pool.full_kv_pool
    assert pool.get_key_buffer(3) is full.k_buffer[1]  # type: ignore[attr-defined]
    assert pool.get_value_buffer(1) is full.v_buffer[0]  # type: ignore[attr-defined]
    key, value = pool.get_kv_buffer(3)
    assert key is full.k_buffer[1] and value is full.v_buffer[1]  # type: ignore[attr-defined]


def test_a_counter_registered_on_the_hybrid_waits_by_full_attention_id() -> None:
    # the controller's counter counts full-attention layers: model layer 3 waits on layer 1
    pool = hybrid()
    counter = Recorder()
    pool.register_layer_transfer_counter(counter)
    assert pool.layer_transfer_counter is counter
    assert pool.full_kv_pool.layer_transfer_counter is counter
    pool.get_key_buffer(3)
    pool.get_value_buffer(1)
    assert counter.waits == [1, 0]


def test_layer_end_reaches_the_notifiers_for_full_layers_only() -> None:
    pool = hybrid()
    heard: list[int] = []
    pool.register_layer_backup_notifier(heard.append)
    for model_layer in range(4):
        pool.notify_layer_end(model_layer)
    assert heard == [0, 1]  # full-attention ids; linear layers 0 and 2 have nothing to back up


def test_linear_state_belongs_to_linear_layers_only() -> None:
    pool = HybridLinearKVPool(
        full_pool(), [1, 3], [0, 2], linear_state_shape=(3, 2), linear_state_slots=5
    )
    assert pool.get_linear_state(2).shape == (5, 3, 2)
    with pytest.raises(LayerRangeError, match=r"model layer 1 has no linear-attention state"):
        pool.get_linear_state(1)


@pytest.mark.parametrize("verb", ["get_key_buffer", "get_value_buffer", "get_kv_buffer"])
@pytest.mark.parametrize(
    ("layer_id", "kind"), [(2, "a linear-attention layer"), (7, "not a layer")]
)
def test_kv_buffers_of_a_linear_or_unknown_layer_are_refused(
    verb: str, layer_id: int, kind: str
) -> None:
    with pytest.raises(
        LayerRangeError,
        match=rf"model layer {layer_id} is {kind} of this hybrid pool; full-attention "
        r"layers: \[1, 3\]",
    ):
        getattr(hybrid(), verb)(layer_id)


def test_layer_end_of_an_unknown_layer_is_refused() -> None:
    with pytest.raises(LayerRangeError, match=r"model layer 9 is not a layer"):
        hybrid().notify_layer_end(9)


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("check_layer_id", (0,)),
        ("component_buffer", ("k", 0)),
        ("layer_buffers", (0,)),
        ("read_rows", ("k", 0, torch.arange(4))),
        ("write_rows", ("k", 0, torch.arange(4), torch.zeros(4, 2, 2))),
    ],
)
def test_the_transfer_local_surface_points_at_full_kv_pool(method: str, args: Any) -> None:
    # a controller that forgot to unwrap fails at its first copy, not by moving wrong layers
    with pytest.raises(
        HiCacheInputError,
        match=rf"HybridLinearKVPool\.{method} takes transfer-local layer ids, which only its "
        r"full_kv_pool has \(unwrap the pool",
    ):
        getattr(hybrid(), method)(*args)


BAD_LAYER_IDS = [
    pytest.param([1], [0, 2], r"must name each of full_kv_pool's 2 layers exactly once", id="few"),
    pytest.param([1, 1], [0], r"must name each of full_kv_pool's 2 layers", id="dup-full"),
    pytest.param([1, 3], [0, 0, 2], r"must be distinct and disjoint", id="dup-linear"),
    pytest.param([1, 3], [1, 2], r"must be distinct and disjoint", id="overlap"),
    pytest.param([1, 4], [0, 2], r"ids \[0, 1, 2, 4\] must together be one contiguous", id="gap"),
    pytest.param([-1, 1], [0], r"starting at start_layer >= 0", id="negative"),
]


@pytest.mark.parametrize(("full_ids", "linear_ids", "match"), BAD_LAYER_IDS)
def test_layer_ids_that_do_not_tile_the_model_are_refused(
    full_ids: list[int], linear_ids: list[int], match: str
) -> None:
    with pytest.raises(HiCacheInputError, match=match):
        HybridLinearKVPool(full_pool(2), full_ids, linear_ids)


def test_a_pipeline_stage_may_start_at_a_later_model_layer() -> None:
    pool = HybridLinearKVPool(full_pool(2), [5, 7], [4, 6])
    assert (pool.start_layer, pool.layer_num) == (4, 4)
    assert pool.get_key_buffer(7) is pool.full_kv_pool.k_buffer[1]  # type: ignore[attr-defined]


def test_a_hybrid_pool_inside_a_hybrid_pool_is_refused() -> None:
    inner = hybrid()
    with pytest.raises(HiCacheInputError, match=r"got HybridLinearKVPool"):
        HybridLinearKVPool(inner, [1, 3], [0, 2])
    with pytest.raises(HiCacheInputError, match=r"got str"):
        HybridLinearKVPool("pool", [1], [0])  # type: ignore[arg-type]


@pytest.mark.parametrize(("shape", "slots"), [((), 4), ((0,), 4), ((4,), 0)])
def test_a_linear_state_without_room_is_refused(shape: tuple[int, ...], slots: int) -> None:
    with pytest.raises(HiCacheInputError, match=r"linear state needs >= 1 slot"):
        HybridLinearKVPool(
            full_pool(), [1, 3], [0, 2], linear_state_shape=shape, linear_state_slots=slots
        )


def test_interleaved_layer_ids_tile_the_model() -> None:
    assert interleaved_layer_ids(2) == ([1, 3], [0, 2])
    assert interleaved_layer_ids(2, 3, start_layer=8) == ([11, 15], [8, 9, 10, 12, 13, 14])
    assert interleaved_layer_ids(3, 0) == ([0, 1, 2], [])
    pool = HybridLinearKVPool(full_pool(2), *interleaved_layer_ids(2, 3))
    assert (pool.start_layer, pool.layer_num) == (0, 8)
    with pytest.raises(HiCacheInputError, match=r"needs full_layers >= 1"):
        interleaved_layer_ids(0)
