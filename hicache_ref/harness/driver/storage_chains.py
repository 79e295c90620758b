"""The chains a storage world backs up and prefetches: whole-page runs under a parent chain.

A ``Chain`` has a content id (its tree handle: what the oracle's rows of its pages derive from,
and the handle of the host-only node a prefetch of it becomes), a parent (another chain already
in L3, or the root) and one of two token patterns, so pages that end alike sit under different
parents (a key that restarts its chain collides, INV-27), while the ``ChainBook`` never makes
two chains of one prefix. ``fill_chain`` writes a chain's oracle rows into host slots and yields
the digest of every page, which is what the harness's L3 model expects to read back (INV-30).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hicache_ref.harness.world.content import expected_rows
from hicache_ref.harness.world.recording_storage import page_digest
from hicache_ref.invariants.storage_snapshot import Prefix
from hicache_ref.pools.host_pool import HostKVCache

CHAIN_PAGES_MAX = 3
PATTERNS = 2
RANK_CONTENT_STRIDE = 1 << 20
"""A TP rank's content id offset (its shard differs); MLA ranks hold the same KV."""


@dataclass
class Chain:
    """A page run the harness backs up: its content id (= its tree handle) and its parent."""

    uid: int
    parent: Chain | None
    pattern: int
    pages: int
    state: str = "none"  # none | writing | stored | partial
    keys: tuple[str, ...] = ()  # rank 0's page keys (the implementation's hashing)
    acked: dict[int, int] = field(default_factory=dict)  # rank -> pages its last ack stored

    def tokens(self, page: int) -> tuple[int, ...]:
        return tuple(1 + self.pattern * page + (i % page) for i in range(self.pages * page))

    def prefix(self, page: int) -> Prefix:
        base = self.parent.prefix(page) if self.parent is not None else ()
        return base + self.tokens(page)

    def chain_keys(self) -> tuple[str, ...]:
        return (self.parent.chain_keys() if self.parent is not None else ()) + self.keys


class ChainBook:
    """Every chain of a case, by content id."""

    def __init__(self, page: int, *, mla: bool) -> None:
        self.page = page
        self.mla = mla
        self.chains: dict[int, Chain] = {}

    def backup_candidates(self) -> list[int]:
        """Chains not in L3 whose parent is (or is the root)."""
        return sorted(
            uid
            for uid, c in self.chains.items()
            if c.state == "none" and (c.parent is None or c.parent.state == "stored")
        )

    def prefetch_candidates(self, busy: set[int]) -> list[int]:
        """Chains with pages in L3 under a stored parent, not being prefetched now."""
        return sorted(
            uid
            for uid, c in self.chains.items()
            if c.state in ("stored", "partial")
            and (c.parent is None or c.parent.state == "stored")
            and uid not in busy
        )

    def forget_stored(self) -> None:
        """A rank's clear: no chain is in L3 on every rank, so none is stored or partial (each
        may be backed up again, parents first)."""
        for chain in self.chains.values():
            if chain.state in ("stored", "partial"):
                chain.state, chain.acked = "none", {}

    def new_chain(self, pick: int, uid: int) -> Chain | None:
        """A new chain under a stored parent, with a (parent, pattern) not used before."""
        parents: list[Chain | None] = [None] + [
            c for c in self.chains.values() if c.state == "stored"
        ]
        used = {(id(c.parent), c.pattern) for c in self.chains.values()}
        for offset in range(len(parents) * PATTERNS):
            choice = (pick + offset) % (len(parents) * PATTERNS)
            parent, pattern = parents[choice // PATTERNS], choice % PATTERNS
            if (id(parent), pattern) not in used:
                chain = Chain(uid, parent, pattern, 1 + pick % CHAIN_PAGES_MAX)
                self.chains[uid] = chain
                return chain
        return None

    def content_uid(self, rank: int, chain: Chain) -> int:
        return chain.uid if self.mla else chain.uid + rank * RANK_CONTENT_STRIDE


def fill_chain(
    host_pool: HostKVCache,
    uid: int,
    chain: Chain,
    slots: torch.Tensor,
    layer_num: int,
    draft: bool = False,
) -> Iterator[tuple[Prefix, str]]:
    """The oracle's rows of content ``uid`` (its draft layers' with ``draft``) into ``slots``;
    (prefix, digest) of every page."""
    page = host_pool.page_size
    positions = torch.arange(slots.numel())
    for c, name in enumerate(host_pool.device_pool.component_names()):
        shape = tuple(host_pool.row_shapes[name])
        for layer in range(layer_num):
            host_pool.write_rows(
                name, layer, slots, expected_rows(uid, draft, layer, c, positions, shape)
            )
    prefix = chain.prefix(page)
    start = len(prefix) - slots.numel()
    for i in range(chain.pages):
        digest = page_digest(host_pool.get_data_page(int(slots[i * page]), True))
        yield prefix[: start + (i + 1) * page], digest


def scribble_draft_rows(draft_pool: HostKVCache, slots: torch.Tensor, value: float) -> None:
    """Every draft layer's rows at ``slots`` set to ``value``: a bounce buffer the tree just
    gave a prefetch holds no draft page until L3's is read into it, so a page counted without
    its draft read shows the scribble, not a stale copy of the same content (INV-37)."""
    for name in draft_pool.device_pool.component_names():
        for layer in range(draft_pool.device_pool.layer_num):
            rows = draft_pool.read_rows(name, layer, slots)
            draft_pool.write_rows(name, layer, slots, torch.full_like(rows, value))
