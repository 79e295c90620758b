"""The oracle's fixed world: pool geometry, the node universe, and the protocol variant.

Everything here is frozen and hashable, because it rides inside every oracle state. A
``ProtocolVariant`` with one flag set is a *planted bug*: it changes exactly one step function
(or the enabling rule of one op) so a test can show that the checkers catch it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Literal

from hicache_ref.errors import HiCacheInputError, UnknownOptionError

Pool = Literal["target", "draft"]
StreamName = Literal["forward", "write", "load"]
Direction = Literal["d2h", "h2d"]

POOLS: tuple[Pool, ...] = ("target", "draft")
STREAMS: tuple[StreamName, ...] = ("forward", "write", "load")
FORWARD, WRITE, LOAD = 0, 1, 2
"""Indices of the three streams in ``OracleState.streams``."""


@dataclass(frozen=True)
class ProtocolVariant:
    """Planted bugs, one flag each; the comment names the invariant that must catch it."""

    free_host_before_write_ack: bool = False
    """The tree may evict a node's host copy while its write ack is undrained (INV-07)."""
    duplicate_write_ack: bool = False
    """``write`` appends its ack twice (INV-02)."""
    load_ack_before_last_layer: bool = False
    """The load ack's finish event is recorded before the last layer's copies (INV-04, INV-09)."""
    skip_owner_replay: bool = False
    """``load_cp`` allocates device pages without replaying ``page_owners`` (INV-03)."""
    no_fence_before_d2h: bool = False
    """The D2H copies do not wait for the forward stream's KV stores (INV-12)."""
    skip_draft_layers: bool = False
    """A per-layer write is called done once its target layers are (INV-04)."""
    reuse_busy_producer_slot: bool = False
    """The tree starts a load without a free producer slot (INV-10)."""
    skip_layer_gate: bool = False
    """A forward read does not wait for its layer's load event (INV-11)."""
    zero_owned_rank_drops_load: bool = False
    """A CP rank that owns no page of a node queues no load op for it (INV-14)."""
    cancel_keeps_layer_state: bool = False
    """``cancel_layer_write_state`` forgets to pop the pending state (INV-15)."""
    cancel_without_sync: bool = False
    """``cancel_layer_write_state`` frees host slots without synchronizing the write stream (INV-07)."""
    reset_keeps_acks: bool = False
    """``reset`` leaves the ack queues in place (INV-18)."""
    drain_ignores_finish: bool = False
    """The tree drains acks without querying their finish events (INV-09)."""
    evict_device_while_loading: bool = False
    """The tree may evict a node whose load is still in flight (INV-08)."""

    def enabled_flags(self) -> tuple[str, ...]:
        """The names of the flags that are set, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


PLANTED_BUGS: dict[str, str] = {
    "free_host_before_write_ack": "INV-07",
    "duplicate_write_ack": "INV-02",
    "load_ack_before_last_layer": "INV-04",
    "skip_owner_replay": "INV-03",
    "no_fence_before_d2h": "INV-12",
    "skip_draft_layers": "INV-04",
    "reuse_busy_producer_slot": "INV-10",
    "skip_layer_gate": "INV-11",
    "zero_owned_rank_drops_load": "INV-14",
    "cancel_keeps_layer_state": "INV-15",
    "cancel_without_sync": "INV-07",
    "reset_keeps_acks": "INV-18",
    "drain_ignores_finish": "INV-09",
    "evict_device_while_loading": "INV-08",
}
"""Each planted bug and the invariant id whose checker must report it first or alongside."""


def make_variant(*flags: str) -> ProtocolVariant:
    """A variant with the named flags set; unknown names raise ``UnknownOptionError``."""
    known = {f.name for f in fields(ProtocolVariant)}
    for flag in flags:
        # Verify the flag exists, so a typo does not silently test the correct protocol
        if flag not in known:
            raise UnknownOptionError(f"unknown protocol variant {flag!r}; legal: {sorted(known)}")
    return ProtocolVariant(**{flag: True for flag in flags})


@dataclass(frozen=True)
class OracleConfig:
    """Pool geometry and the node universe. Sizes are in pages; every rank is alike.

    ``cp_size == 0`` is the plain (non-CP) controller: one rank, no per-layer write API.
    ``cp_size >= 1`` is CP shared KV over ``cp_size`` ranks driven in lockstep; logical device
    page ``p`` is owned by rank ``page_owner_table[p]`` (default ``p % cp_size``).
    Node ``n`` holds ``node_tokens[n]`` tokens on ``ceil(tokens / page_size)`` whole pages.
    The universe grows as a harness inserts nodes (``Insert(node, tokens=...)``, see
    ``with_node_tokens``); ``max_tokens`` fixes the content-tag stride so that every tag keeps its
    meaning when it does (0: ``max(node_tokens)``, for a fixed universe).
    ``harness_schedule`` admits the harness tree's looser, still correct schedule (see
    ``step``): stores of each pool in layer order, reads of any stored or loaded layer, and
    frees of a node whose own forward work is still queued (the forward stream is FIFO).
    With ``settle_records`` an event record runs as soon as it reaches the head of its stream
    (a GPU completes it with the work ahead of it); without it each record needs an ``Advance``.
    """

    page_size: int = 2
    layer_num: int = 2
    draft_layer_num: int = 0
    device_pages: int = 4
    host_pages: int = 4
    draft_host_pages: int = 4
    cp_size: int = 0
    num_counters: int = 5
    node_tokens: tuple[int, ...] = (2, 2)
    page_owner_table: tuple[int, ...] = ()
    settle_records: bool = True
    variant: ProtocolVariant = field(default_factory=ProtocolVariant)
    max_tokens: int = 0
    harness_schedule: bool = False

    def __post_init__(self) -> None:
        # Verify every size is positive, so the oracle never models an empty pool by accident
        if self.page_size < 1 or self.layer_num < 1 or self.draft_layer_num < 0:
            raise HiCacheInputError(
                f"page_size={self.page_size} and layer_num={self.layer_num} must be >= 1 and "
                f"draft_layer_num={self.draft_layer_num} >= 0"
            )
        if self.device_pages < 1 or self.host_pages < 1 or self.draft_host_pages < 0:
            raise HiCacheInputError(
                "device_pages and host_pages must be >= 1 and draft_host_pages >= 0"
            )
        if not 0 <= self.cp_size <= 8 or self.num_counters < 1:
            raise HiCacheInputError(
                f"cp_size={self.cp_size} must be in [0, 8] (0 = no CP); num_counters >= 1"
            )
        if (not self.node_tokens and self.max_tokens < 1) or min(self.node_tokens, default=1) < 1:
            raise HiCacheInputError(
                "node_tokens must name at least one node (or max_tokens >= 1 for a universe that "
                "grows), each >= 1 token"
            )
        if self.max_tokens and max(self.node_tokens, default=0) > self.max_tokens:
            raise HiCacheInputError(
                f"node_tokens {self.node_tokens} exceed max_tokens={self.max_tokens}"
            )
        if self.page_owner_table:
            self._check_owner_table()

    def _check_owner_table(self) -> None:
        # Verify the owner table covers every device page with a legal rank (INV-03 needs it)
        if len(self.page_owner_table) != self.device_pages:
            raise HiCacheInputError(
                f"page_owner_table has {len(self.page_owner_table)} entries; need one per "
                f"device page ({self.device_pages})"
            )
        if any(not 0 <= o < self.num_ranks for o in self.page_owner_table):
            raise HiCacheInputError(
                f"page_owner_table entries must be ranks in [0, {self.num_ranks})"
            )

    @property
    def num_ranks(self) -> int:
        return max(1, self.cp_size)

    @property
    def uses_cp(self) -> bool:
        return self.cp_size >= 1

    @property
    def has_draft(self) -> bool:
        return self.draft_layer_num > 0

    @property
    def num_nodes(self) -> int:
        return len(self.node_tokens)

    @cached_property
    def num_channels(self) -> int:
        """Target layers then draft layers: channel ``c`` is one (pool, layer)."""
        return self.layer_num + self.draft_layer_num

    @property
    def total_layers(self) -> int:
        """Layers a load or a per-layer write walks: ``max(layer_num, draft_layer_num)``."""
        return max(self.layer_num, self.draft_layer_num)

    @cached_property
    def token_stride(self) -> int:
        """Distinct tokens per node in a content tag (see ``geometry.compute_token_tag``)."""
        return self.max_tokens or max(self.node_tokens)

    def with_node_tokens(self, node: int, tokens: int) -> OracleConfig:
        """This world with node ``node`` holding ``tokens`` tokens: the universe grows by one
        node (``node == num_nodes``) or an id is re-sized (ids restart after a reset)."""
        # Verify the universe grows one id at a time and the tag stride is fixed (max_tokens)
        if not 0 <= node <= self.num_nodes:
            raise HiCacheInputError(
                f"node {node} would leave a hole in the universe [0, {self.num_nodes})"
            )
        if not self.max_tokens or not 1 <= tokens <= self.max_tokens:
            raise HiCacheInputError(
                f"a growing universe needs max_tokens >= tokens={tokens} (got {self.max_tokens})"
            )
        sizes = (*self.node_tokens[:node], tokens, *self.node_tokens[node + 1 :])
        return replace(self, node_tokens=sizes)

    def page_owner(self, page: int) -> int:
        """The rank that owns logical device page ``page``."""
        if self.page_owner_table:
            return self.page_owner_table[page]
        return page % self.num_ranks

    def node_pages(self, node: int) -> int:
        """How many whole pages node ``node`` occupies."""
        return -(-self.node_tokens[node] // self.page_size)

    def layers_of(self, pool: Pool) -> int:
        return self.layer_num if pool == "target" else self.draft_layer_num

    def describe(self) -> str:
        """One line that names the world, for CLI output and failure messages."""
        bugs = ",".join(self.variant.enabled_flags()) or "none"
        return (
            f"nodes={self.node_tokens} page={self.page_size} layers={self.layer_num} "
            f"draft={self.draft_layer_num} device_pages={self.device_pages} "
            f"host_pages={self.host_pages} cp={self.cp_size} counters={self.num_counters} "
            f"planted={bugs}{' harness_schedule' if self.harness_schedule else ''}"
        )
