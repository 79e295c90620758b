"""A PP world's config and build: 2 PP storage ranks of upstream's hybrid controller, attached.

The PP tree (``pp_tree.PpTree``) drives a world built here; what it needs of the world, in the
order a PP world is made:

- ``pp_config``: the world's ``HarnessConfig``: 2 PP storage ranks over the KV alone
  (``anchor``), with the draft pool riding on the KV's slots (``sidecar``), or with an
  independent SWA side pool of its own slots whose window goes to L3 beside the KV
  (``swa_window``: ``pool_group="swa"``, ``storage_swa_window``), or with a Mamba state pool
  whose one state page per chain goes to L3 under the chain's last page key (``mamba``:
  ``pool_group="mamba"``, ``storage_swa_window=1``);
- ``build_pp_world``: the world's ranks, attached to one shared L3, their PP command group
  checked (``PpWorld``); on 0.5.21 - 0.5.22 (``carries_rank_0_hit``) attached as "mooncake",
  the only backend those releases open the command group for;
- ``Chain``, ``page_keys_of``, ``page_value``, ``side_value``, ``state_value``: what the
  world's backups store (each rank's own bytes, a page's SWA rows or a chain's Mamba state too)
  and under which keys;
- ``RequestHandle``: the request a ticket names (upstream's ``CacheRequestHandle``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.storage_world import StorageWorld
from hicache_ref.harness.world.world import World, build_world

PP_RANKS = 2
MOONCAKE = "mooncake"  # 0.5.21 - 0.5.22 enable PP tickets only for a backend of this name
SIDE_DEVICE_PAGES = 8  # an SWA or Mamba world's side pool: device pages of its own allocator
SIDE_HOST_PAGES = 16  # ... and host pages (its own slots; a ticket's window is 3 pages at most)


def pp_config(
    *, sidecar: bool = False, swa_window: int = 0, mamba: bool = False, **fields: Any
) -> HarnessConfig:
    """A PP world's config: 2 PP storage ranks over a KV-only group, small pools; ``sidecar``:
    with a one-layer draft pool riding on the KV's slots (its pages beside the KV's in L3 and
    on every ticket: the ticket's ``pool_specs``); ``swa_window`` (1 .. 3 pages): with a
    one-layer independent SWA side pool of its own slots, whose window of that many pages every
    backup stores and every ticket names (a ``TRAILING_PAGES`` pool spec); ``mamba``: with a
    Mamba state pool (pages of one slot), whose one state page per chain every backup stores
    under the chain's last page key and every ticket names (a one-key ``TRAILING_PAGES`` spec,
    as 0.5.23's ``MambaComponent.prepare_prefetch`` names it)."""
    if sum((sidecar, bool(swa_window), mamba)) > 1:
        raise ValueError(
            "a PP world has one of a draft sidecar, an SWA side pool or a Mamba state pool"
        )
    group: dict[str, Any] = {"pool_group": "sidecar", "draft_layer_num": 1} if sidecar else {}
    if swa_window or mamba:
        group = {
            "pool_group": "mamba" if mamba else "swa",
            "draft_layer_num": 1,
            "side_device_pages": SIDE_DEVICE_PAGES,
            "draft_host_pages": SIDE_HOST_PAGES,
            "storage_swa_window": 1 if mamba else swa_window,
        }
    base: dict[str, Any] = {
        "page_size": 2,
        "layer_num": 2,
        "pool_group": "anchor",
        **group,
        "storage_ranks": PP_RANKS,
        "storage_pp": True,
        "storage_batch_pages": 2,
        "host_pages": 16,
        "device_pages": 16,
    }
    return HarnessConfig(**{**base, **fields})


def carries_rank_0_hit(hybrid: Any) -> bool:
    """0.5.21 - 0.5.22's tickets carry the hit PP rank 0 found (``storage_hit_count``): PP rank
    0 queries every PP rank's shard in ``submit_prefetch`` and the command threads stage that hit
    without a query; 0.5.23+'s carry none (every rank queries its own shard, then a MIN)."""
    fields = getattr(getattr(hybrid, "PPPrefetchTicket", None), "__dataclass_fields__", {})
    return "storage_hit_count" in fields


@dataclass
class PpWorld:
    """A built PP world: its (refined) config, storage world and every rank's controller."""

    config: HarnessConfig
    world: World
    storage: StorageWorld
    cc: list[Any]
    hybrid: Any  # upstream's hybrid_cache_controller module
    carries_hit: bool


def build_pp_world(implementation: Implementation, config: HarnessConfig) -> PpWorld:
    """The world of ``config`` (refined by ``implementation``), attached to its shared L3."""
    import sys

    refine = getattr(implementation, "refine_config", None)
    config = refine(config) if callable(refine) else config
    if not config.storage_pp or config.storage_ranks != PP_RANKS:
        raise HiCacheSetupError(
            f"{implementation.name} draws no PP storage world (capability storage:pp)"
        )
    world = build_world(config, implementation)
    storage = StorageWorld(world, implementation)
    cc: list[Any] = storage.controllers
    hybrid = sys.modules[type(cc[0]).__mro__[1].__module__]
    carries_hit = carries_rank_0_hit(hybrid)
    storage.attach(MOONCAKE if carries_hit else "")
    if carries_hit:  # Mooncake's zero-copy page calls are its client's, not the PP
        for controller in cc:  # protocol's: the harness's clients take flat pages
            controller.page_get_func = controller._generic_page_get
            controller.page_set_func = controller._generic_page_set
    if any(getattr(c, "pp_prefetch_command_group", None) is None for c in cc):
        raise HiCacheSetupError(
            "upstream's attach made no PP command group (enable_pp_ticket: buffer_only "
            "host memory and a PP group of 2+ ranks)"
        )
    return PpWorld(config, world, storage, cc, hybrid, carries_hit)


def page_keys_of(tokens: tuple[int, ...], page: int, controller: Any) -> list[str]:
    """The content keys of a chain from the root, as upstream's radix cache computes them."""
    keys: list[str] = controller._harness_page_keys(list(tokens), None, page)
    return keys


def page_value(rank: int, chain: int, page: int) -> float:
    """The first element of page ``page`` of chain ``chain`` on PP rank ``rank`` (its layers)."""
    return float((rank + 1) * 1_000_000 + chain * 1_000 + page + 1)


def side_value(rank: int, chain: int, page: int) -> float:
    """The first element of the SWA side pool's page ``page`` of chain ``chain`` on PP rank
    ``rank`` (its own bytes, never a KV page's)."""
    return -page_value(rank, chain, page)


def state_value(rank: int, chain: int) -> float:
    """The first element of chain ``chain``'s Mamba state on PP rank ``rank`` (the state after
    its last page: its own bytes, never a KV page's or an SWA page's)."""
    return -page_value(rank, chain, 0) - 0.5


@dataclass(frozen=True)
class RequestHandle:
    """Upstream's ``CacheRequestHandle`` (the harness stubs its module): a ticket pickles it."""

    rid: str
    attempt_id: int = 0


@dataclass(frozen=True)
class Chain:
    """A chain the world backed up: its tokens and, per rank, its page keys."""

    index: int
    tokens: tuple[int, ...]
    keys: tuple[str, ...]
