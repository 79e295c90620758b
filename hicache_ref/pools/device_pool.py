"""Device KV pools: per-layer buffers on ``device_module.device``, indexed by token loc.

Mirrors SGLang 0.5.10 ``memory_pool.py`` at the level the controller sees it:

- every buffer has ``size + page_size`` rows (the extra page is the padding page);
- ``get_key_buffer`` / ``get_value_buffer`` / ``get_kv_buffer`` first call
  ``layer_transfer_counter.wait_until(layer_id - start_layer)``: this is how the forward stream
  waits for the per-layer H2D of a loading batch (INV-11). ``layer_buffers`` does not wait; the
  transfer code uses it;
- ``notify_layer_end`` is the fork's per-layer backup hook: the forward calls it after storing a
  layer, and every registered notifier (target and draft controller hooks) gets the local layer id
  so the D2H of that layer can be ordered after the store (INV-12).

Layer ids: ``get_*_buffer`` and ``notify_layer_end`` take the model's layer id
(``start_layer .. start_layer + layer_num - 1``, as the forward knows it); ``layer_buffers``,
``read_rows`` and ``write_rows`` and all transfers take the pool-local id ``0 .. layer_num - 1``.

Components: a pool is a tuple of named components (MHA: ``k``, ``v``; MLA: ``kv``; NSA: ``kv`` and
the indexer sidecar ``index_k``). Every transfer moves every component (sglang#17085 lost the NSA
sidecar because a host pool moved only ``kv``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from hicache_ref.device.protocol import DeviceModule
from hicache_ref.errors import HiCacheInputError, LayerRangeError
from hicache_ref.pools.page_index import check_index_tensor


class LayerTransferCounter(Protocol):
    """What a device pool waits on before handing a layer to the forward (``LayerDoneCounter``)."""

    def wait_until(self, threshold: int) -> None: ...


LayerBackupNotifier = Callable[[int], None]
"""Called with the local layer id after the forward stored that layer."""


class KVCache(ABC):
    """A device KV pool: ``layer_num`` layers of named components, ``size + page_size`` rows each."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device_module: DeviceModule,
        start_layer: int = 0,
    ) -> None:
        # Verify geometry: non-negative size, positive pages and layers
        if size < 0:
            raise HiCacheInputError(f"device pool size must be >= 0 tokens, got {size}")
        if page_size < 1:
            raise HiCacheInputError(f"page_size must be >= 1, got {page_size}")
        if layer_num < 1:
            raise HiCacheInputError(f"layer_num must be >= 1, got {layer_num}")
        if start_layer < 0:
            raise HiCacheInputError(f"start_layer must be >= 0, got {start_layer}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.device_module = device_module
        self.device: torch.device = device_module.device
        self.layer_transfer_counter: LayerTransferCounter | None = None
        self._backup_notifiers: list[LayerBackupNotifier] = []
        row_shapes = self.component_row_shapes()
        for name, row_shape in row_shapes.items():
            if not row_shape or any(dim < 1 for dim in row_shape):
                raise HiCacheInputError(
                    f"component {name!r} needs a positive row shape, got {row_shape}"
                )
        self._buffers: dict[str, list[torch.Tensor]] = {
            name: [
                torch.zeros((size + page_size, *row_shape), dtype=dtype, device=self.device)
                for _ in range(layer_num)
            ]
            for name, row_shape in row_shapes.items()
        }
        self._component_names = tuple(self._buffers)  # asked on every transfer and read

    # ------------------------------------------------------------------ geometry
    @abstractmethod
    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of one token row of each component, in component order."""

    def component_names(self) -> tuple[str, ...]:
        """The components every transfer must move, in a fixed order."""
        return self._component_names

    def get_size_per_token(self) -> int:
        """Bytes one token occupies over all layers and components."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = sum(math.prod(shape) for shape in self.component_row_shapes().values())
        return per_layer * itemsize * self.layer_num

    # ------------------------------------------------------------------ hooks
    def register_layer_transfer_counter(self, counter: LayerTransferCounter) -> None:
        """Make ``get_*_buffer`` wait on ``counter`` (the controller's ``LayerDoneCounter``)."""
        self.layer_transfer_counter = counter

    def register_layer_backup_notifier(self, fn: LayerBackupNotifier) -> None:
        """Add a hook called with the local layer id after each layer's KV store."""
        self._backup_notifiers.append(fn)

    def notify_layer_end(self, layer_id: int) -> None:
        """The forward stored layer ``layer_id`` (model id): tell every backup notifier."""
        local_layer_id = self._local_from_model_layer(layer_id)
        for notifier in self._backup_notifiers:
            notifier(local_layer_id)

    # ------------------------------------------------------------------ buffers
    def check_layer_id(self, layer_id: int) -> int:
        """Return the local ``layer_id`` or raise ``LayerRangeError``."""
        if not 0 <= layer_id < self.layer_num:
            raise LayerRangeError(
                f"layer_id {layer_id} is outside [0, layer_num) = [0, {self.layer_num}) "
                "(pool-local layer ids)"
            )
        return layer_id

    def _local_from_model_layer(self, layer_id: int) -> int:
        end_layer = self.start_layer + self.layer_num
        if not self.start_layer <= layer_id < end_layer:
            raise LayerRangeError(
                f"layer_id {layer_id} is outside [start_layer, start_layer + layer_num) = "
                f"[{self.start_layer}, {end_layer}) (local [0, {self.layer_num}))"
            )
        return layer_id - self.start_layer

    def _wait_for_layer(self, layer_id: int) -> int:
        """Local id of model layer ``layer_id``, after waiting for its H2D (INV-11)."""
        local_layer_id = self._local_from_model_layer(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local_layer_id)
        return local_layer_id

    def component_buffer(self, component: str, layer_id: int) -> torch.Tensor:
        """The buffer of ``component`` for local layer ``layer_id`` (no wait)."""
        if component not in self._buffers:
            raise HiCacheInputError(
                f"unknown component {component!r}; this pool has {self.component_names()}"
            )
        return self._buffers[component][self.check_layer_id(layer_id)]

    def component_buffers(self, component: str) -> tuple[torch.Tensor, ...]:
        """Every local layer's buffer of ``component``, in layer order (no wait): one call where
        a transfer plans all layers at once."""
        if component not in self._buffers:
            raise HiCacheInputError(
                f"unknown component {component!r}; this pool has {self.component_names()}"
            )
        return tuple(self._buffers[component])

    def layer_buffers(self, layer_id: int) -> list[torch.Tensor]:
        """One buffer per component for local layer ``layer_id``, rows by token loc (no wait)."""
        local_layer_id = self.check_layer_id(layer_id)
        return [buffers[local_layer_id] for buffers in self._buffers.values()]

    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The key buffer of model layer ``layer_id``, after waiting for its load."""

    @abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The value buffer of model layer ``layer_id``, after waiting for its load."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers of model layer ``layer_id``, after waiting for its load."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # ------------------------------------------------------------------ harness access
    def read_rows(self, component: str, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        """A CPU copy of rows ``locs`` (synchronous; for tests and checkers, never stream work)."""
        buffer = self.component_buffer(component, layer_id)
        check_index_tensor(locs, "locs")
        return buffer[locs.to(device=buffer.device, dtype=torch.int64)].cpu()

    def write_rows(
        self, component: str, layer_id: int, locs: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Overwrite rows ``locs`` synchronously (for tests and checkers, never stream work)."""
        buffer = self.component_buffer(component, layer_id)
        check_index_tensor(locs, "locs")
        buffer[locs.to(device=buffer.device, dtype=torch.int64)] = values.to(
            device=buffer.device, dtype=buffer.dtype
        )


class MHATokenToKVPool(KVCache):
    """Multi-head attention KV: components ``k`` and ``v``, rows ``(head_num, head_dim)``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device_module: DeviceModule,
        start_layer: int = 0,
    ) -> None:
        self.head_num = head_num
        self.head_dim = head_dim
        super().__init__(size, page_size, dtype, layer_num, device_module, start_layer)
        self.k_buffer = self._buffers["k"]
        self.v_buffer = self._buffers["v"]

    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.head_num, self.head_dim), "v": (self.head_num, self.head_dim)}

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[self._wait_for_layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[self._wait_for_layer(layer_id)]


class MLATokenToKVPool(KVCache):
    """Multi-head latent attention: one ``kv`` component, rows ``(1, kv_lora_rank + rope_dim)``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device_module: DeviceModule,
        start_layer: int = 0,
    ) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        super().__init__(size, page_size, dtype, layer_num, device_module, start_layer)
        self.kv_buffer = self._buffers["kv"]

    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"kv": (1, self.kv_lora_rank + self.qk_rope_head_dim)}

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[self._wait_for_layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent part ``[..., :kv_lora_rank]`` of the ``kv`` rows (a view)."""
        return self.kv_buffer[self._wait_for_layer(layer_id)][..., : self.kv_lora_rank]


class NSATokenToKVPool(MLATokenToKVPool):
    """MLA plus the NSA indexer sidecar ``index_k`` (rows ``(1, index_head_dim)``).

    The sidecar is indexed by the same token locs and must travel with the KV in every transfer
    (sglang#17085: it was never backed up, so decode after a cache hit read stale index keys).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device_module: DeviceModule,
        *,
        index_head_dim: int,
        start_layer: int = 0,
    ) -> None:
        self.index_head_dim = index_head_dim
        super().__init__(
            size,
            page_size,
            dtype,
            kv_lora_rank,
            qk_rope_head_dim,
            layer_num,
            device_module,
            start_layer,
        )
        self.index_k_buffer = self._buffers["index_k"]

    def component_row_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().component_row_shapes()
        shapes["index_k"] = (1, self.index_head_dim)
        return shapes

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        """The indexer keys of model layer ``layer_id``, after waiting for its load."""
        return self.index_k_buffer[self._wait_for_layer(layer_id)]
