"""Read-only questions a harness asks the oracle: slot owners, predicted tags, ack rows, locks.

*Predicted* tags are what the oracle's own copies moved (``get_device_tag``/``get_host_tag``);
*expected* tags are what a settled copy must hold (``get_expected_resident_tags``). In a correct
run they agree for every settled copy; a harness compares the real bytes against the expected
ones and decodes a mismatch with ``decode_tag``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_ref.oracle.config import STREAMS, OracleConfig, Pool
from hicache_ref.oracle.geometry import (
    FREE,
    compute_channel,
    compute_owned_positions,
    compute_token_tag,
    decode_token_tag,
    holder_node,
)
from hicache_ref.oracle.invariants import (
    _settled_device_channels,
    _settled_host_channels,
)
from hicache_ref.oracle.state import CopyPages, Lifecycle, OracleState, ReadKv, StoreKv


@dataclass(frozen=True)
class SlotOwner:
    """Who holds a page: ``kind`` is ``free``, ``owned`` or ``reserved`` (in-flight backup)."""

    kind: str
    node: int = -1


@dataclass(frozen=True)
class ResidentTag:
    """One slot of a settled copy and the tag it must hold. ``rank`` is -1 for device slots."""

    pool: Pool
    layer: int
    rank: int
    slot: int
    node: int
    token: int
    tag: int


def get_lifecycle(state: OracleState, node: int) -> Lifecycle:
    """Where node ``node``'s KV lives now (see ``state.Lifecycle``)."""
    return state.nodes[node].lifecycle


def get_lock_ref(state: OracleState, node: int) -> int:
    """The tree locks the oracle holds on ``node`` (write in flight, load pin)."""
    return state.nodes[node].lock_ref


def _owner(holder: int) -> SlotOwner:
    if holder == FREE:
        return SlotOwner("free")
    return SlotOwner("owned" if holder >= 0 else "reserved", holder_node(holder))


def get_device_page_owner(state: OracleState, page: int) -> SlotOwner:
    """Holder of logical device page ``page``."""
    return _owner(state.device_holders[page])


def get_host_page_owner(
    state: OracleState, page: int, pool: Pool = "target", rank: int = 0
) -> SlotOwner:
    """Holder of host page ``page`` of ``pool`` on ``rank``."""
    return _owner(state.host_holders[0 if pool == "target" else 1][rank][page])


def get_device_tag(state: OracleState, loc: int, layer: int, pool: Pool = "target") -> int:
    """The tag the oracle predicts device slot ``loc`` of ``(pool, layer)`` holds now."""
    channel = compute_channel(state.config.layer_num, pool == "draft", layer)
    return state.device_tags[channel][loc]


def get_host_tag(
    state: OracleState, slot: int, layer: int, pool: Pool = "target", rank: int = 0
) -> int:
    """The tag the oracle predicts host slot ``slot`` of ``(pool, layer)`` on ``rank`` holds."""
    channel = compute_channel(state.config.layer_num, pool == "draft", layer)
    return state.host_tags[channel][rank][slot]


def decode_tag(config: OracleConfig, tag: int) -> tuple[int, int] | None:
    """``(node, token)`` whose KV a tag stands for, or None for garbage."""
    return decode_token_tag(tag, config.token_stride)


@dataclass(frozen=True)
class InFlightUse:
    """A queued op that still reads or writes a page: its stream, kind and nodes."""

    stream: str
    kind: str
    nodes: tuple[int, ...]


def get_device_page_users(state: OracleState, page: int) -> tuple[InFlightUse, ...]:
    """Queued stores, reads and copies that still use logical device page ``page`` (INV-08)."""
    uses: list[InFlightUse] = []
    for name, queue in zip(STREAMS, state.streams, strict=True):
        for op in queue:
            if isinstance(op, StoreKv | ReadKv) and page in op.pages:
                uses.append(InFlightUse(name, type(op).__name__, (op.node,)))
            elif isinstance(op, CopyPages) and any(d == page for _, _, d in op.pairs):
                uses.append(InFlightUse(name, f"copy_{op.direction}", op.nodes))
    return tuple(uses)


def get_host_page_users(
    state: OracleState, page: int, pool: Pool = "target", rank: int = 0
) -> tuple[InFlightUse, ...]:
    """Queued copies that still read or write host page ``page`` of ``pool`` on ``rank`` (INV-07)."""
    draft = pool == "draft"
    uses: list[InFlightUse] = []
    for name, queue in zip(STREAMS, state.streams, strict=True):
        for op in queue:
            if (
                isinstance(op, CopyPages)
                and (op.channel >= state.config.layer_num) == draft
                and any(r == rank and h == page for r, h, _ in op.pairs)
            ):
                uses.append(InFlightUse(name, f"copy_{op.direction}", op.nodes))
    return tuple(uses)


def get_write_ack_rows(state: OracleState, rank: int = 0) -> tuple[tuple[int, ...], ...]:
    """The node ids of each undrained write ack of ``rank``, oldest first."""
    return tuple(ack.node_ids for ack in state.write_acks[rank])


def get_load_ack_rows(state: OracleState, rank: int = 0) -> tuple[tuple[int, ...], ...]:
    """The node ids of each undrained load ack of ``rank``, oldest first."""
    return tuple(ack.node_ids for ack in state.load_acks[rank])


def get_host_pages(
    state: OracleState, node: int, pool: Pool = "target"
) -> tuple[tuple[int, ...], ...]:
    """Node ``node``'s host pages per rank (empty without a host copy)."""
    record = state.nodes[node]
    return record.host_pages if pool == "target" else record.draft_host_pages


def get_device_pages(state: OracleState, node: int) -> tuple[int, ...]:
    """Node ``node``'s logical device pages in token order (empty when evicted)."""
    return state.nodes[node].device_pages


def get_expected_resident_tags(state: OracleState) -> tuple[ResidentTag, ...]:
    """Every slot of every settled copy with the tag it must hold (what INV-06 compares)."""
    config = state.config
    ps = config.page_size
    expected: list[ResidentTag] = []
    for node, record in enumerate(state.nodes):
        tokens = config.node_tokens[node]
        for channel in _settled_device_channels(state, node, record):
            pool, layer = _pool_layer(config, channel)
            for position, page in enumerate(record.device_pages):
                for offset in range(ps):
                    token = position * ps + offset
                    if token < tokens:
                        tag = compute_token_tag(node, token, config.token_stride)
                        expected.append(
                            ResidentTag(pool, layer, -1, page * ps + offset, node, token, tag)
                        )
        for channel in _settled_host_channels(state, node, record):
            pool, layer = _pool_layer(config, channel)
            per_rank = record.draft_host_pages if pool == "draft" else record.host_pages
            for rank, pages in enumerate(per_rank):
                positions = compute_owned_positions(record.page_owners, rank)
                for host_page, position in zip(pages, positions, strict=True):
                    for offset in range(ps):
                        token = position * ps + offset
                        if token < tokens:
                            tag = compute_token_tag(node, token, config.token_stride)
                            slot = host_page * ps + offset
                            expected.append(ResidentTag(pool, layer, rank, slot, node, token, tag))
    return tuple(expected)


def _pool_layer(config: OracleConfig, channel: int) -> tuple[Pool, int]:
    if channel >= config.layer_num:
        return "draft", channel - config.layer_num
    return "target", channel
