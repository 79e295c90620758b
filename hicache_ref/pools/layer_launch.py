"""Per-layer launches of one index pair, checked once per operation.

The controller loads a batch layer by layer (``load_to_device_per_layer`` once per layer, the
same two index tensors each time) and the CP write-back backs one up the same way. Every check
such a transfer needs (index bounds and signs, unique destinations, page chunks: INV-01, INV-05;
the buffers of every layer and every batch copy inside them: INV-06) depends on the index pair
and the pools, not on the layer, so the host pool prepares the pair once
(``transfer.prepare_transfer``) and keeps it here, with each layer's launch (closure, label,
meta) once built. A later layer is then a dict hit and the launch call.

A ``LayerLaunches`` entry is served only while

- the two index tensors are the same objects as when it was prepared (the entry holds them and
  the device pool, so their ids cannot be reused by other objects while it is cached),
- at the same in-place versions (``Tensor._version``: ``t[0] = 5``, ``copy_``, ``add_`` and
  every other in-place write bumps it; a changed tensor is checked and planned anew),
- the direction and ``io_backend`` are the same,

and the host pool drops them all when its ``copy_path`` or ``triton_launch`` is set and when it
is cleared (``HostKVCache.clear``). What it cannot see, like ``PLAN_CACHE``: a write that
bypasses the version counter (through ``t.data``, ``t.numpy()`` or a raw pointer). Index
tensors made under ``torch.inference_mode`` have no version counter and are not cached (each
launch checks them again). Both pools' buffers are allocated at construction and never
replaced, so the addresses a prepared pair's closures hold stay theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from hicache_ref.pools.copy_plan import read_versions
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.transfer import PreparedTransfer
from hicache_ref.pools.transfer_checks import Direction

LAYER_LAUNCH_PAIRS_MAX = 8
"""Index pairs one host pool keeps (each holds its tensors and plan alive)."""

PairKey = tuple[int, int, int, Direction, str]
"""``(id(host_indices), id(device_indices), id(device_pool), direction, io_backend)``."""


class LayerLaunch(NamedTuple):
    """One layer's launch: ``device_module.launch(fn, label=label, kind="copy", meta=meta)``
    (``meta`` is shared by the launches of this layer of the pair: observers read it, the
    simulator copies it)."""

    fn: Callable[[], None]
    label: str
    meta: dict[str, object]


class PreparedPair:
    """One index pair prepared for one device pool, direction and io backend, and the launches
    of the layers built from it so far."""

    __slots__ = (
        "device_indices",
        "device_pool",
        "device_version",
        "host_indices",
        "host_version",
        "layers",
        "prepared",
    )

    def __init__(
        self,
        prepared: PreparedTransfer,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        host_version: int,
        device_version: int,
    ) -> None:
        self.prepared = prepared
        self.device_pool = device_pool
        self.host_indices = host_indices
        self.device_indices = device_indices
        self.host_version = host_version
        self.device_version = device_version
        self.layers: dict[int, LayerLaunch] = {}

    def launch_of(self, layer: int) -> LayerLaunch:
        """The launch of ``layer`` (a layer the device pool has: checked by the caller), built
        on first use and kept."""
        launch = self.layers.get(layer)
        if launch is None:
            launch = self.layers[layer] = launch_of(self.prepared, layer)
        return launch


def launch_of(prepared: PreparedTransfer, layer: int) -> LayerLaunch:
    """The launch of one layer of ``prepared`` (its label made here: once per pair and layer)."""
    layers = (layer,)
    label = f"{prepared.direction} layer {layer}"
    return LayerLaunch(prepared.closure(layers), label, prepared.meta(layers))


class LayerLaunches:
    """The prepared index pairs of one host pool, the newest ``entries_max`` (see module doc)."""

    def __init__(self, entries_max: int = LAYER_LAUNCH_PAIRS_MAX) -> None:
        assert entries_max >= 1
        self.entries_max = entries_max
        self._entries: dict[PairKey, PreparedPair] = {}
        self._lock = threading.Lock()  # add and clear; a lookup is one dict read
        self.prepared_pairs = 0
        """Pairs prepared and kept so far (a test reads it to see a pair prepared again)."""

    def current(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        direction: Direction,
        io_backend: str,
    ) -> PreparedPair | None:
        """The kept pair of these objects, or ``None`` (not prepared, or changed in place since).

        The entry holds the objects whose ids key it, so an id match is the same object; this
        runs on every per-layer launch, so it reads no more than the key and two versions."""
        try:
            pair = self._entries.get(
                (id(host_indices), id(device_indices), id(device_pool), direction, io_backend)
            )
        except TypeError:  # an unhashable io_backend: the checks name the legal values
            return None
        if (
            pair is None
            or pair.host_version != host_indices._version
            or pair.device_version != device_indices._version
        ):
            return None
        return pair

    def add(
        self,
        prepared: PreparedTransfer,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> PreparedPair | None:
        """Keep ``prepared`` for this pair (the oldest pair goes past the bound); ``None``, and
        nothing kept, for tensors without a version counter."""
        versions = read_versions(host_indices, device_indices)
        if versions is None:
            return None
        pair = PreparedPair(prepared, device_pool, host_indices, device_indices, *versions)
        key = (
            id(host_indices),
            id(device_indices),
            id(device_pool),
            prepared.direction,
            io_backend,
        )
        with self._lock:
            self._entries.pop(key, None)  # re-inserted as the newest
            while len(self._entries) >= self.entries_max:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = pair
            self.prepared_pairs += 1
        return pair

    def build(
        self,
        pair: PreparedPair | None,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
        layer: int,
        prepare: Callable[[], PreparedTransfer],
    ) -> LayerLaunch:
        """The launch of ``layer`` (a layer of ``device_pool``: checked by the caller): from
        ``pair`` (``current``'s answer) when there is one, else from ``prepare()`` (every check),
        kept for the pair's later layers when the tensors have version counters."""
        if pair is None:
            prepared = prepare()
            pair = self.add(prepared, device_pool, host_indices, device_indices, io_backend)
            if pair is None:  # no version counter: prepared for this launch only
                return launch_of(prepared, layer)
        # Verify the pair is these objects' (its ids keyed the lookup, and it keeps them alive)
        assert pair.host_indices is host_indices and pair.device_indices is device_indices
        assert pair.device_pool is device_pool
        return pair.launch_of(layer)

    def clear(self) -> None:
        """Forget every pair (the pool's copy path changed, or it was cleared)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
