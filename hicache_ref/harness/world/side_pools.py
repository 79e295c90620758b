"""An independent side pool: the SWA entry of a ``HostPoolGroup`` with rows and slots of its own.

Upstream 0.5.19+'s hybrid models (sliding-window attention beside full attention, Mamba
state beside KV) cache each pool in its own host pool: a side pool's device rows come from its
own allocator (``device_alloc_fn``), its host slots from its own host pool's allocator
(``HostPoolGroup.resolve_host_transfers``), and its layers sit between the anchor's in the
transfer ids, where the anchor's ``layer_mapper`` says None. In ``pool_group="swa"`` worlds the
harness's draft pool is that side pool (``HarnessConfig.has_side_pools``), in the order a world
uses what is here:

- ``SideLayout``: which transfer layer ids are the anchor's (KV) and which the side pool's,
  interleaved (side, KV, side, KV, ...), and the mappers of each (None in the other's ids);
- ``build_side_allocator``: the side pool's own device allocator over the draft device pool;
- ``MappedCounter``: a pool's layer counter as its forward waits on it, by the transfer id
  of the pool's local layer (upstream's pools wait by model layer id, which the transfer ids
  are);
- ``side_pool_focus``: a mutant's ``refine_config`` that turns every drawn world into a
  side-pool world (the reference holds the side pool itself, ``controller/side_pool.py``);
  ``side_window_focus``: into a storage world whose side pool's window goes to L3 too.

A Mamba side pool (``pool_group="mamba"``) is a state pool: a node holds one state slot there
(upstream's ``PoolTransfer(MAMBA, device_indices=<one slot>)``), not one row per token, so its
allocator and host pool count slots (a page of one slot, ``HarnessConfig.side_page_size``) and
a node's rows there are ``HarnessConfig.side_rows`` of its tokens. ``make_state_pool`` builds
its device pool and ``state_bytes_per_slot`` is the harness's own model of a slot's bytes.

What a node holds in the side pool (its own device rows, its own host slots) is the tree's
model (``Node.side_value``, ``Node.side_host``), never what the controller says of itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hicache_ref.harness.world.config import SIDE_POOL_GROUPS, STATE_POOL_GROUPS, HarnessConfig

if TYPE_CHECKING:
    from hicache_ref.device.protocol import DeviceModule
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.device_pool import KVCache

SIDE_SEED_OFFSET = 3
"""The side allocator's seed: the config seed plus this (the host pools take +1 and +2)."""


@dataclass(frozen=True)
class SideLayout:
    """The transfer layer ids of the anchor's and the side pool's layers (disjoint, together
    ``0 .. total - 1``)."""

    kv_ids: tuple[int, ...]
    side_ids: tuple[int, ...]

    @property
    def total(self) -> int:
        return len(self.kv_ids) + len(self.side_ids)

    def mapper(self, side: bool) -> Callable[[int], int | None]:
        """Transfer layer id -> the pool's own layer (None where the other pool's layer is)."""
        local = {tid: i for i, tid in enumerate(self.side_ids if side else self.kv_ids)}
        return local.get

    def transfer_id(self, side: bool, layer: int) -> int:
        """The transfer id of a pool's local layer (what its forward waits on)."""
        return (self.side_ids if side else self.kv_ids)[layer]


def side_layout(config: HarnessConfig) -> SideLayout:
    """Side and KV layers alternate, a side layer first (a window layer before each global
    one, as the hybrid SWA models interleave them), then whatever one pool has left."""
    kv, side = config.layer_num, config.draft_layer_num
    kv_ids: list[int] = []
    side_ids: list[int] = []
    tid = 0
    for i in range(max(kv, side)):
        if i < side:
            side_ids.append(tid)
            tid += 1
        if i < kv:
            kv_ids.append(tid)
            tid += 1
    return SideLayout(tuple(kv_ids), tuple(side_ids))


class MappedCounter:
    """A layer counter as one pool's forward waits on it: local layer -> its transfer id."""

    def __init__(self, counter: Any, layout: SideLayout, side: bool) -> None:
        self._counter = counter
        self._layout = layout
        self._side = side

    def wait_until(self, threshold: int) -> None:
        self._counter.wait_until(self._layout.transfer_id(self._side, threshold))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._counter, name)


MAMBA_STATE_HEADS, MAMBA_STATE_DIM = 2, 6
"""A state slot's row per layer and component: (heads, state dim), wider than a KV token's row
(``world.MHA_HEADS`` x ``MHA_HEAD_DIM``), so a slot read as a token row cannot pass."""
MAMBA_STATE_COMPONENTS = ("conv", "temporal")
"""What the state pool's two components hold, in its component order (upstream's Mamba state
is a conv state and a temporal (SSM) state per layer); the pool names them ``k`` and ``v``."""


def make_state_pool(config: HarnessConfig, device: DeviceModule) -> KVCache:
    """A Mamba state pool's device pool: ``side_device_pages`` slots (a page of one slot), two
    components (conv, temporal) of ``MAMBA_STATE_HEADS x MAMBA_STATE_DIM`` per layer, one row per
    slot. The host pool built over it has pages of one slot as well."""
    from hicache_ref.harness.world.content import HARNESS_DTYPE
    from hicache_ref.pools.device_pool import MHATokenToKVPool

    assert config.has_state_pool
    return MHATokenToKVPool(
        config.side_device_pages,
        config.side_page_size,
        HARNESS_DTYPE,
        MAMBA_STATE_HEADS,
        MAMBA_STATE_DIM,
        config.draft_layer_num,
        device,
    )


def state_bytes_per_slot(config: HarnessConfig) -> int:
    """The bytes one node's state slot holds over every layer and component, from the harness's
    geometry (not from a pool's description of itself): what a backup moves to the host and a
    load moves back, per node."""
    from hicache_ref.harness.world.content import HARNESS_DTYPE

    itemsize = torch.empty((), dtype=HARNESS_DTYPE).element_size()
    per_layer = len(MAMBA_STATE_COMPONENTS) * MAMBA_STATE_HEADS * MAMBA_STATE_DIM * itemsize
    return per_layer * config.draft_layer_num


def build_side_allocator(
    config: HarnessConfig, side_device_pool: KVCache, device: DeviceModule
) -> PagedTokenToKVPoolAllocator:
    """The side pool's own device allocator (pages ``1 .. side_device_pages``, each
    ``side_page_size`` rows: one slot in a state pool)."""
    from hicache_ref.harness.world.content import HARNESS_DTYPE
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        config.side_device_pages * config.side_page_size,
        config.side_page_size,
        HARNESS_DTYPE,
        device.device,
        side_device_pool,
        alloc_policy=config.draft_alloc_policy,
        seed=config.seed + SIDE_SEED_OFFSET,
    )


def side_pool_focus(**fields: Any) -> Callable[[HarnessConfig], HarnessConfig]:
    """A mutant's ``refine_config``: the drawn world with an independent side pool (no CP, no
    storage; the draft layers, side device pages and host pages kept where drawn), ``fields``
    set over it."""

    def focus(config: HarnessConfig) -> HarnessConfig:
        group = fields.get("pool_group", SIDE_POOL_GROUPS[0])
        update: dict[str, Any] = {
            "cp_size": 0,
            "storage_ranks": 0,  # and what only a storage world may set
            "storage_host_pressure": False,
            "storage_swa_window": 0,
            "storage_pp": False,
            "storage_buffer_only": False,
            "pool_group": group,
            # a drawn Mamba world's copy-on-write loads stay only where the focus keeps Mamba
            "state_cow": config.state_cow and group in STATE_POOL_GROUPS,
            "draft_layer_num": config.draft_layer_num or 2,
            "side_device_pages": config.side_device_pages or max(2, config.device_pages // 2),
            "draft_host_pages": config.draft_host_pages or config.host_pages,
        }
        return HarnessConfig.model_validate({**config.model_dump(), **update, **fields})

    return focus


def state_pool_focus(**fields: Any) -> Callable[[HarnessConfig], HarnessConfig]:
    """A mutant's ``refine_config``: the drawn world with a Mamba state pool (as
    ``side_pool_focus``) and pages of at least two tokens, so a state counted per anchor page
    or per token takes more than its one slot; ``fields`` set over it."""
    side = side_pool_focus(pool_group="mamba", **fields)

    def focus(config: HarnessConfig) -> HarnessConfig:
        pages = {"page_size": max(2, config.page_size)}
        without_storage = {
            "storage_host_pressure": False,
            "storage_swa_window": 0,
            "storage_pp": False,
            "storage_buffer_only": False,
        }
        data = {**config.model_dump(), **pages, **without_storage, "storage_ranks": 0}
        return side(HarnessConfig.model_validate(data))

    return focus


def side_window_focus(**fields: Any) -> Callable[[HarnessConfig], HarnessConfig]:
    """A mutant's ``refine_config``: the drawn world as a storage world whose side pool's window
    goes to L3 (an SWA pool's ``storage_swa_window`` kept where drawn, else 2 pages; a Mamba
    state pool's one page), under host pressure, so hits are often served cut below the
    window; ``fields`` set over it (``pool_group="mamba"`` for a state pool)."""
    side = side_pool_focus(**{k: v for k, v in fields.items() if k == "pool_group"})

    def focus(config: HarnessConfig) -> HarnessConfig:
        world = side(config)
        window = 1 if world.has_state_pool else config.storage_swa_window or 2
        update: dict[str, Any] = {
            "storage_ranks": config.storage_ranks or 2,
            "storage_swa_window": window,
            "storage_host_pressure": True,
            "storage_policy": "wait_complete",
        }
        return HarnessConfig.model_validate({**world.model_dump(), **update, **fields})

    return focus
