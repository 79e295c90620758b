"""Side pools in L3: SGLang's v2 batch calls (``batch_*_v2``) over the v1 page store.

A hybrid model caches more than the KV pool: a draft model's KV, an indexer, a window's
state. SGLang 0.5.19+ stores each such *sidecar* pool's page beside the KV page of the same
content key, under ``<key>.<pool>`` (``HiCacheFile``'s component key), and moves them with
``PoolTransfer`` descriptors. A *KV-derived* sidecar rides on the KV pool's host slots
(``indices_from_pool="kv"``: its host pool is indexed like the KV host pool), so a page is
usable only when its KV page and every sidecar page of it were stored and read back: the
all-or-nothing rule (INV-37). In the order a page meets them:

- ``PoolTransfer``: one pool's part of a call: its name, host slots and page keys, and how a
  hit query judges it (``hit_policy``: ``all_pages``, every page of the KV hit must hold the
  pool's page too; ``trailing_pages``, only the window of the last ``len(keys)`` pages);
- ``restorable_prefixes``: the prefix lengths whose trailing window a pool holds;
- ``component_key``: the key a sidecar page is stored under;
- ``PoolTransferResult``: what ``batch_exists_v2`` answers: the usable KV prefix (the minimum
  over the KV pool and every sidecar) and each pool's own leading run;
- ``count_pool_hits``: a per-page success list -> its leading run (a page after a failed one
  is never usable).

The backend side is ``HiCacheStorage.batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``
(``backend.py``), written over the v1 batch calls, so every backend, the fault layer and the
harness's recording layer see a sidecar page as one more page call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

KV_POOL = "kv"
"""The anchor pool's name: its pages are stored under the bare content key."""
DRAFT_POOL = "draft"
"""A draft model's KV pool (SGLang's ``PoolName.DRAFT``), the sidecar this project stores."""
SWA_POOL = "swa"
"""An independent sliding-window pool (SGLang's ``PoolName.SWA``): its own host slots, its
pages named by the trailing window of a hit."""
MAMBA_POOL = "mamba"
"""An independent Mamba state pool (SGLang's ``PoolName.MAMBA``): one state slot per node, its
page (one slot) stored under the node's last page key, the trailing window of one page."""
WINDOW_POOLS = (SWA_POOL, MAMBA_POOL)
"""The independent pools whose L3 pages are a hit's trailing window (their own host slots)."""
ALL_PAGES = "all_pages"
"""Every page of the KV hit needs the pool's page too (a KV-derived sidecar)."""
TRAILING_PAGES = "trailing_pages"
"""Only the last ``len(transfer.keys)`` pages of a prefix need the pool's page (SWA, Mamba):
a prefix is restorable where its trailing window is stored, so the restorable prefixes may
have holes (``PoolTransferResult.restorable_prefix_pages``)."""


def pool_name(name: object) -> str:
    """A pool's name as a string (SGLang's ``PoolName`` is a ``str`` enum; its value)."""
    return str(getattr(name, "value", name))


def component_key(key: str, pool: object) -> str:
    """The key a pool's page is stored under: the content key, ``.<pool>`` for a sidecar."""
    name = pool_name(pool)
    return key if name == KV_POOL else f"{key}.{name}"


@dataclass
class PoolTransfer:
    """One pool's part of a v2 call (SGLang's ``PoolTransfer``, host <-> storage half)."""

    name: str
    host_indices: torch.Tensor | None = None
    keys: list[str] | None = None
    hit_policy: str = ALL_PAGES
    indices_from_pool: str | None = None


@dataclass
class PoolTransferResult:
    """``batch_exists_v2``'s answer (SGLang's ``PoolTransferResult``)."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[str, int] = field(default_factory=dict)
    restorable_prefix_pages: list[int] | None = None


def restorable_prefixes(present: Sequence[bool], trailing: int) -> list[int]:
    """Prefix lengths ``p`` (1 .. len(present)) whose last ``trailing`` pages are all present
    (``HiCacheFile.batch_exists_v2``'s ``trailing_pages`` rule)."""
    assert trailing >= 1
    return [
        p
        for p in range(1, len(present) + 1)
        if all(present[i] for i in range(max(0, p - trailing), p))
    ]


def count_pool_hits(results: Mapping[str, Sequence[bool]]) -> dict[str, int]:
    """Each pool's leading run of successful pages."""
    hits: dict[str, int] = {}
    for name, flags in results.items():
        run = 0
        for ok in flags:
            if not ok:
                break
            run += 1
        hits[pool_name(name)] = run
    return hits
