"""HybridLinearKVPool: a model with full-attention and linear-attention layers (SGLang's pool).

Hybrid models (Qwen3-Next and friends) interleave full-attention layers, whose KV is indexed by
token loc like any other pool's, with linear-attention (Mamba-like) layers, whose state is one
fixed-size tensor per request. HiCache caches only the former: the controller unwraps the pool
to ``full_kv_pool`` (``isinstance(pool, HybridLinearKVPool)``, as upstream 0.5.10 does) and from
then on sees an ordinary MHA/MLA/NSA pool whose ``layer_num`` counts full-attention layers only.

What a controller, an allocator or a forward touches, in SGLang's names:

- ``full_kv_pool``: the MHA/MLA/NSA pool of the full-attention layers; every transfer and every
  hook of the controller goes there, and its layer ids are full-attention ids ``0 .. F-1``;
- ``full_attention_layer_id_mapping``: model layer id -> full-attention layer id;
- ``get_key_buffer`` / ``get_value_buffer`` / ``get_kv_buffer`` / ``notify_layer_end`` take the
  model's layer id and forward to ``full_kv_pool`` under the mapped id, so the forward waits on
  the controller's per-layer load events by full-attention id (INV-11) and the backup hook hears
  full-attention ids (INV-12); a linear layer has no KV and no backup;
- ``get_linear_state``: the linear-attention state of one model layer. The controller never
  transfers it (HiCache does not cache it), which the round-trip tests check byte for byte.

The token-indexed surface (``layer_buffers``, ``read_rows``, ...) takes transfer-local layer ids,
which only ``full_kv_pool`` has: on the hybrid pool it refuses, naming ``full_kv_pool``, so a
controller that forgot to unwrap fails at its first copy instead of moving the wrong layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_ref.errors import HiCacheInputError, LayerRangeError
from hicache_ref.pools.device_pool import KVCache, LayerBackupNotifier, LayerTransferCounter


class HybridLinearKVPool(KVCache):
    """Full-attention KV (``full_kv_pool``) plus per-request linear-attention state."""

    def __init__(
        self,
        full_kv_pool: KVCache,
        full_attention_layer_ids: Sequence[int],
        linear_attention_layer_ids: Sequence[int],
        *,
        linear_state_shape: tuple[int, ...] = (4,),
        linear_state_slots: int = 4,
    ) -> None:
        # Not KVCache.__init__: the full-attention buffers live in full_kv_pool (as upstream)
        _check_full_pool(full_kv_pool)
        full_ids, linear_ids = _check_layer_ids(
            full_kv_pool, full_attention_layer_ids, linear_attention_layer_ids
        )
        if linear_state_slots < 1 or not linear_state_shape or min(linear_state_shape) < 1:
            raise HiCacheInputError(
                f"linear state needs >= 1 slot and a positive shape, got "
                f"linear_state_slots={linear_state_slots}, shape={linear_state_shape}"
            )
        self.full_kv_pool = full_kv_pool
        self.full_attention_layer_id_mapping = {lid: i for i, lid in enumerate(full_ids)}
        self.linear_attention_layer_ids = linear_ids
        self.full_layer_nums = len(full_ids)
        self.size = full_kv_pool.size
        self.page_size = full_kv_pool.page_size
        self.dtype = full_kv_pool.dtype
        self.device_module = full_kv_pool.device_module
        self.device = full_kv_pool.device
        self.start_layer = min(full_ids + linear_ids)
        self.layer_num = len(full_ids) + len(linear_ids)
        """Model layers this pool spans; transfers use ``full_kv_pool.layer_num``."""
        self._linear_state = {
            lid: torch.zeros(
                (linear_state_slots, *linear_state_shape), dtype=self.dtype, device=self.device
            )
            for lid in linear_ids
        }

    # ------------------------------------------------------------------ geometry
    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.full_kv_pool.component_row_shapes()

    def component_names(self) -> tuple[str, ...]:
        return self.full_kv_pool.component_names()

    def get_size_per_token(self) -> int:
        """Bytes per token: the full-attention KV only (linear state is per request)."""
        return self.full_kv_pool.get_size_per_token()

    # ------------------------------------------------------------------ layer ids
    def full_attention_layer_id(self, layer_id: int) -> int:
        """The full-attention layer id of model layer ``layer_id`` (upstream's
        ``_transfer_full_attention_id``); a linear or unknown layer is refused."""
        if layer_id in self.full_attention_layer_id_mapping:
            return self.full_attention_layer_id_mapping[layer_id]
        kind = "a linear-attention layer" if layer_id in self._linear_state else "not a layer"
        raise LayerRangeError(
            f"model layer {layer_id} is {kind} of this hybrid pool; full-attention layers: "
            f"{sorted(self.full_attention_layer_id_mapping)}"
        )

    def _full_model_layer(self, layer_id: int) -> int:
        """The id ``full_kv_pool``'s forward surface takes for model layer ``layer_id``."""
        return self.full_kv_pool.start_layer + self.full_attention_layer_id(layer_id)

    # ------------------------------------------------------------------ hooks
    @property
    def layer_transfer_counter(self) -> LayerTransferCounter | None:  # type: ignore[override]
        """The full-attention pool's counter: waits are by full-attention id (INV-11)."""
        return self.full_kv_pool.layer_transfer_counter

    def register_layer_transfer_counter(self, counter: LayerTransferCounter) -> None:
        """Forward to ``full_kv_pool``: the counter counts full-attention layers only."""
        self.full_kv_pool.register_layer_transfer_counter(counter)

    def register_layer_backup_notifier(self, fn: LayerBackupNotifier) -> None:
        self.full_kv_pool.register_layer_backup_notifier(fn)

    def notify_layer_end(self, layer_id: int) -> None:
        """The forward stored model layer ``layer_id``; only full-attention layers back up."""
        if layer_id in self._linear_state:
            return  # linear-attention state is not cached by HiCache: nothing to back up
        self.full_kv_pool.notify_layer_end(self._full_model_layer(layer_id))

    # ------------------------------------------------------------------ forward surface
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._full_model_layer(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._full_model_layer(layer_id))

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full_kv_pool.get_kv_buffer(self._full_model_layer(layer_id))

    def get_linear_state(self, layer_id: int) -> torch.Tensor:
        """The per-request state of linear-attention model layer ``layer_id`` (never cached)."""
        if layer_id not in self._linear_state:
            raise LayerRangeError(
                f"model layer {layer_id} has no linear-attention state; linear layers: "
                f"{list(self.linear_attention_layer_ids)}"
            )
        return self._linear_state[layer_id]

    # ------------------------------------------------------------------ transfer-local surface
    def check_layer_id(self, layer_id: int) -> int:
        raise _no_local_layers("check_layer_id")

    def component_buffer(self, component: str, layer_id: int) -> torch.Tensor:
        raise _no_local_layers("component_buffer")

    def component_buffers(self, component: str) -> tuple[torch.Tensor, ...]:
        raise _no_local_layers("component_buffers")

    def layer_buffers(self, layer_id: int) -> list[torch.Tensor]:
        raise _no_local_layers("layer_buffers")

    def read_rows(self, component: str, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        raise _no_local_layers("read_rows")

    def write_rows(
        self, component: str, layer_id: int, locs: torch.Tensor, values: torch.Tensor
    ) -> None:
        raise _no_local_layers("write_rows")


def interleaved_layer_ids(
    full_layers: int, linear_per_full: int = 1, start_layer: int = 0
) -> tuple[list[int], list[int]]:
    """(full, linear) model layer ids where each full layer follows ``linear_per_full`` linear
    ones (Qwen3-Next: 3), starting at ``start_layer``; for building hybrid pools in tests."""
    if full_layers < 1 or linear_per_full < 0 or start_layer < 0:
        raise HiCacheInputError(
            f"interleaved_layer_ids needs full_layers >= 1, linear_per_full >= 0 and "
            f"start_layer >= 0, got {full_layers}, {linear_per_full}, {start_layer}"
        )
    period = linear_per_full + 1
    full = [start_layer + period * i + linear_per_full for i in range(full_layers)]
    linear = [
        start_layer + period * i + j for i in range(full_layers) for j in range(linear_per_full)
    ]
    return full, linear


def unwrap_full_kv_pool(pool: KVCache) -> KVCache:
    """The pool HiCache transfers: ``full_kv_pool`` of a hybrid pool, else ``pool`` itself."""
    return pool.full_kv_pool if isinstance(pool, HybridLinearKVPool) else pool


def _no_local_layers(method: str) -> HiCacheInputError:
    return HiCacheInputError(
        f"HybridLinearKVPool.{method} takes transfer-local layer ids, which only its "
        "full_kv_pool has (unwrap the pool: pool.full_kv_pool, as the controller does)"
    )


def _check_full_pool(full_kv_pool: object) -> None:
    # Verify the full-attention pool is a plain token-indexed pool, not another hybrid
    if not isinstance(full_kv_pool, KVCache) or isinstance(full_kv_pool, HybridLinearKVPool):
        raise HiCacheInputError(
            f"full_kv_pool must be an MHA/MLA/NSA device pool, got {type(full_kv_pool).__name__}"
        )


def _check_layer_ids(
    full_kv_pool: KVCache, full_ids_in: Sequence[int], linear_ids_in: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Full and linear ids: disjoint, each once, together one contiguous run of model layers."""
    full_ids, linear_ids = tuple(int(i) for i in full_ids_in), tuple(int(i) for i in linear_ids_in)
    # Verify one full-attention id per layer of full_kv_pool, each once
    if len(set(full_ids)) != len(full_ids) or len(full_ids) != full_kv_pool.layer_num:
        raise HiCacheInputError(
            f"full_attention_layer_ids={list(full_ids)} must name each of full_kv_pool's "
            f"{full_kv_pool.layer_num} layers exactly once"
        )
    # Verify every model layer is exactly one kind
    if len(set(linear_ids)) != len(linear_ids) or set(full_ids) & set(linear_ids):
        raise HiCacheInputError(
            f"linear_attention_layer_ids={list(linear_ids)} must be distinct and disjoint from "
            f"full_attention_layer_ids={list(full_ids)}"
        )
    every = sorted(full_ids + linear_ids)
    # Verify the layers form one contiguous run [start_layer, start_layer + layer_num)
    if every[0] < 0 or every != list(range(every[0], every[0] + len(every))):
        raise HiCacheInputError(
            f"full and linear layer ids {every} must together be one contiguous run of model "
            "layers starting at start_layer >= 0"
        )
    return full_ids, linear_ids
