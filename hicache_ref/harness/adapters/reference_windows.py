"""The tree's naming of a side pool's L3 window, over the reference controller.

The reference controller takes SGLang's ``extra_pools`` on ``write_storage`` and ``prefetch``
(``controller/storage/side_window.py``); which window a call names is the tree's decision
(0.5.23's ``SWAComponent`` / ``MambaComponent`` build them), and the harness's tree half hands
the adapters a backup's side host slots (``side_host=``) and nothing on a prefetch, as it does
upstream's (``sglang_storage.storage_controller_class``). ``with_window_names(cls)`` is ``cls``
with that naming, in the order a node meets it:

- ``write_storage(..., side_host=)``: the node's SWA host pages with its page keys (every page
  of the chain is in the window), or a Mamba node's one state slot under its last page key;
- ``prefetch``: the window's placeholder keys, one per page ``storage_side.staging_pages``
  names (a Mamba state's one page on every prefetch); the tree stages their slots at the hit.

INV-39 judges what a window holds from the harness's own records
(``harness/driver/storage_side_events.py``), never from these transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.driver.storage_side import staging_pages
from hicache_ref.storage.hashing import Token
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pool_transfers import MAMBA_POOL, TRAILING_PAGES, PoolTransfer

PLACEHOLDER_KEY = "__placeholder__"
"""A prefetch's window key before the hit is known (``_sync_trailing_keys`` replaces it)."""


def with_window_names(cls: type[HiCacheController]) -> type[HiCacheController]:
    """``cls`` whose ``write_storage`` and ``prefetch`` name its side pool's window (a subclass
    built per call: a mutant keeps its mutation, and no class is kept between worlds)."""

    class WindowNamed(cls):  # type: ignore[valid-type, misc]
        window_pages = 0  # the world's window (HarnessConfig.storage_swa_window); 0: none

        def window_pool(self) -> str:
            side = self.side_pool
            return "swa" if side is None else side.name

        def prefetch(
            self,
            request_id: str,
            new_input_tokens: Sequence[Token],
            last_hash: str | None = None,
            prefix_keys: Sequence[str] | None = None,
            extra_pools: Sequence[PoolTransfer] | None = None,
        ) -> PrefetchOperation:
            pool = self.window_pool()
            pages = len(new_input_tokens) // self.page_size
            staging = staging_pages(pages, self.window_pages, last_hash is None, pool == MAMBA_POOL)
            if extra_pools is None and staging:
                keys = [PLACEHOLDER_KEY] * staging
                extra_pools = [PoolTransfer(pool, keys=keys, hit_policy=TRAILING_PAGES)]
            operation: PrefetchOperation = super().prefetch(
                request_id, new_input_tokens, last_hash, prefix_keys, extra_pools
            )
            return operation

        def write_storage(
            self,
            host_indices: torch.Tensor,
            token_ids: Sequence[Token],
            hash_value: Sequence[str] | None = None,
            prefix_keys: Sequence[str] | None = None,
            extra_pools: Sequence[PoolTransfer] | None = None,
            side_host: torch.Tensor | None = None,
        ) -> int:
            if side_host is not None:
                pool = self.window_pool()
                if hash_value is None:  # the radix cache's keys of the node
                    prior = prefix_keys[-1] if prefix_keys else None
                    hash_value = self.storage.compute_page_keys(token_ids, prior)
                keys = list(hash_value)
                pages = 1 if pool == MAMBA_POOL else int(side_host.numel()) // self.page_size
                window = PoolTransfer(
                    pool,
                    host_indices=side_host,
                    keys=keys[len(keys) - pages :],
                    hit_policy=TRAILING_PAGES,
                )
                extra_pools = [window]
            op_id: int = super().write_storage(
                host_indices, token_ids, hash_value, prefix_keys, extra_pools
            )
            return op_id

    WindowNamed.__name__ = cls.__name__
    WindowNamed.__qualname__ = cls.__qualname__
    return WindowNamed


def name_windows(controller: Any, window_pages: int) -> None:
    """Tell a controller of ``with_window_names`` the world's window (pages)."""
    controller.window_pages = window_pages
