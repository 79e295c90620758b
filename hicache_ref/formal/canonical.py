"""Symmetry reduction: one canonical representative per class of equivalent oracle states.

Two states are equivalent when one turns into the other by renaming
- node ids among nodes with the same token count (nothing in the protocol compares ids), and
- pages inside one class: device pages with the same owner rank, host pages of one
  (pool, rank). Freed pages are wiped to ``GARBAGE`` and unreferenced, so they are
  interchangeable, and the oracle's allocators only look at how many pages of a class are free.

``canonicalize`` tries every node renaming; for each it relabels pages in the order nodes and
then queued ops first mention them (free pages last) and keeps the smallest result. Checks are
label-free, so a violation in a representative is a violation in every state of its class.
"""

from __future__ import annotations

import functools
import itertools

from hicache_ref.oracle.config import OracleConfig
from hicache_ref.oracle.geometry import FREE, GARBAGE, holder_node
from hicache_ref.oracle.state import (
    NODE_EVENT_KINDS,
    Ack,
    CopyPages,
    EventName,
    LayerWriteState,
    NodeState,
    OracleState,
    ReadKv,
    RecordEvent,
    StoreKv,
    StreamOp,
    WaitEvent,
    evolve,
)

PageMap = tuple[int, ...]
"""``map[old_page] = new_page``."""


def node_groups(config: OracleConfig) -> tuple[tuple[int, ...], ...]:
    """Nodes that may be renamed into each other: those with the same token count."""
    groups: dict[int, list[int]] = {}
    for node, tokens in enumerate(config.node_tokens):
        groups.setdefault(tokens, []).append(node)
    return tuple(tuple(group) for group in groups.values())


def node_permutations(config: OracleConfig) -> tuple[tuple[int, ...], ...]:
    """Every renaming ``perm[old] = new`` that only swaps nodes with equal token counts."""
    return _perms_within(config.num_nodes, node_groups(config))


def _perms_within(count: int, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    perms: list[tuple[int, ...]] = []
    for choice in itertools.product(*(itertools.permutations(g) for g in groups)):
        perm = list(range(count))
        for group, image in zip(groups, choice, strict=True):
            for old, new in zip(group, image, strict=True):
                perm[old] = new
        perms.append(tuple(perm))
    return tuple(perms)


def _signature(record: NodeState) -> tuple[object, ...]:
    """What a node looks like with every id and page number left out (rename-invariant)."""
    return (
        record.lifecycle,
        record.stores_issued,
        record.backup_channels,
        record.reads_issued,
        record.page_owners,
        record.lock_ref,
        record.load_slot,
        len(record.device_pages),
    )


def _candidate_perms(
    state: OracleState, groups: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    """Renamings that sort each group by signature; only signature ties are left to try."""
    perm = list(range(len(state.nodes)))
    tie_groups: list[tuple[int, ...]] = []
    for group in groups:
        ordered = sorted(group, key=lambda n: repr(_signature(state.nodes[n])))
        for new, old in zip(group, ordered, strict=True):
            perm[old] = new
        signatures = [repr(_signature(state.nodes[n])) for n in ordered]
        for sig in dict.fromkeys(signatures):
            tied = tuple(perm[n] for n, s in zip(ordered, signatures, strict=True) if s == sig)
            if len(tied) > 1:
                tie_groups.append(tied)
    base = tuple(perm)
    if not tie_groups:
        return (base,)
    swaps = _perms_within(len(base), tuple(tie_groups))
    return tuple(tuple(swap[base[old]] for old in range(len(base))) for swap in swaps)


def canonicalize(state: OracleState, groups: tuple[tuple[int, ...], ...]) -> OracleState:
    """The representative of ``state``'s class (see the module docstring).

    Nodes are ordered by their rename-invariant signature; only ties are resolved by trying
    each renaming and keeping the smallest ``(hash, repr)``.
    """
    if state.faults:
        # Fault messages keep their labels; the rest of the state is canonicalized as usual.
        canonical = canonicalize(evolve(state, faults=()), groups)
        return evolve(canonical, faults=state.faults)
    candidates = [relabel(state, perm) for perm in _candidate_perms(state, groups)]
    if len(candidates) == 1:
        return candidates[0]
    keyed = sorted((hash(c), i) for i, c in enumerate(candidates))
    ties = [candidates[i] for h, i in keyed if h == keyed[0][0]]
    if len(ties) == 1:
        return ties[0]
    return min(ties, key=repr)


def relabel(state: OracleState, perm: tuple[int, ...]) -> OracleState:
    """Rename nodes by ``perm`` and pages by first mention; every field follows."""
    config = state.config
    nodes = [NodeState()] * config.num_nodes
    for old, record in enumerate(state.nodes):
        nodes[perm[old]] = record
    device_map = _device_page_map(state, nodes)
    host_maps = _host_page_maps(state, nodes)
    same_nodes = _is_identity(perm)
    if (
        same_nodes
        and _is_identity(device_map)
        and all(_is_identity(m) for per_pool in host_maps for m in per_pool)
    ):
        return state
    tag_table = _tag_table(perm, config)
    new_nodes = tuple(_relabel_node(r, device_map, host_maps) for r in nodes)
    return OracleState(
        config=config,
        nodes=new_nodes,
        device_holders=_permute_holders(state.device_holders, device_map, perm),
        host_holders=tuple(
            tuple(
                _permute_holders(holders, host_maps[pool][rank], perm)
                for rank, holders in enumerate(per_rank)
            )
            for pool, per_rank in enumerate(state.host_holders)
        ),
        device_tags=tuple(
            _permute_tags(tags, device_map, tag_table, config.page_size)
            for tags in state.device_tags
        ),
        host_tags=tuple(
            tuple(
                _permute_tags(tags, host_maps[_pool(config, c)][rank], tag_table, config.page_size)
                for rank, tags in enumerate(per_rank)
            )
            for c, per_rank in enumerate(state.host_tags)
        ),
        streams=tuple(
            tuple(_relabel_op(op, perm, device_map, host_maps, config) for op in queue)
            for queue in state.streams
        ),
        write_acks=tuple(tuple(_relabel_ack(a, perm) for a in q) for q in state.write_acks),
        load_acks=tuple(tuple(_relabel_ack(a, perm) for a in q) for q in state.load_acks),
        load_queue=tuple(tuple(perm[n] for n in q) for q in state.load_queue),
        pending_layer_writes=tuple(
            LayerWriteState(perm[p.node], p.target_done, p.draft_done)
            for p in state.pending_layer_writes
        ),
        producer_index=state.producer_index,
        cancelled=tuple(sorted(perm[n] for n in state.cancelled)),
        fresh_epoch=state.fresh_epoch,
        faults=state.faults,
    )


def _is_identity(mapping: tuple[int, ...]) -> bool:
    return mapping == _identity(len(mapping))


@functools.cache
def _identity(size: int) -> tuple[int, ...]:
    return tuple(range(size))


def _tag_table(perm: tuple[int, ...], config: OracleConfig) -> tuple[int, ...] | None:
    """``table[old_tag] = new_tag`` for a node renaming, or None for the identity."""
    if _is_identity(perm):
        return None
    stride = config.token_stride
    table = [GARBAGE]
    for node in range(config.num_nodes):
        table.extend(1 + perm[node] * stride + token for token in range(stride))
    return tuple(table)


def _pool(config: OracleConfig, channel: int) -> int:
    return 1 if channel >= config.layer_num else 0


def _first_mentions(order: list[int], size: int) -> PageMap:
    """``map[old] = new``: pages in order of first mention, then the unmentioned ones."""
    order = list(dict.fromkeys(order))
    if len(order) < size:
        seen = set(order)
        order += [p for p in range(size) if p not in seen]
    mapping = [0] * size
    for new, old in enumerate(order):
        mapping[old] = new
    return tuple(mapping)


def _device_page_map(state: OracleState, nodes: list[NodeState]) -> PageMap:
    config = state.config
    order = [p for record in nodes for p in record.device_pages]
    for queue in state.streams:
        for op in queue:
            if isinstance(op, StoreKv | ReadKv):
                order.extend(op.pages)
            elif isinstance(op, CopyPages):
                order.extend(d for _, _, d in op.pairs)
    if config.num_ranks == 1 and not config.page_owner_table:
        return _first_mentions(order, config.device_pages)
    # Pages keep their owner rank: relabel inside each class, in order of first mention
    ranked = _first_mentions(order, config.device_pages)
    labels: dict[int, list[int]] = {}
    for page in range(config.device_pages):
        labels.setdefault(config.page_owner(page), []).append(page)
    mapping = [0] * config.device_pages
    for old in sorted(range(config.device_pages), key=lambda p: ranked[p]):
        mapping[old] = labels[config.page_owner(old)].pop(0)
    return tuple(mapping)


def _host_page_maps(state: OracleState, nodes: list[NodeState]) -> list[list[PageMap]]:
    config = state.config
    orders: list[list[list[int]]] = [[[] for _ in per_rank] for per_rank in state.host_holders]
    for record in nodes:
        for pool, spans in enumerate((record.host_pages, record.draft_host_pages)):
            for rank, pages in enumerate(spans):
                orders[pool][rank].extend(pages)
    for queue in state.streams:
        for op in queue:
            if isinstance(op, CopyPages):
                per_rank = orders[_pool(config, op.channel)]
                for rank, host_page, _ in op.pairs:
                    per_rank[rank].append(host_page)
    return [
        [_first_mentions(orders[pool][rank], len(holders)) for rank, holders in enumerate(per_rank)]
        for pool, per_rank in enumerate(state.host_holders)
    ]


def _relabel_node(
    record: NodeState, device_map: PageMap, host_maps: list[list[PageMap]]
) -> NodeState:
    if record.lifecycle in ("absent", "gone"):
        return record
    return NodeState(
        lifecycle=record.lifecycle,
        device_pages=tuple(device_map[p] for p in record.device_pages),
        host_pages=tuple(
            tuple(host_maps[0][r][p] for p in pages) for r, pages in enumerate(record.host_pages)
        ),
        draft_host_pages=tuple(
            tuple(host_maps[1][r][p] for p in pages)
            for r, pages in enumerate(record.draft_host_pages)
        ),
        page_owners=record.page_owners,
        stores_issued=record.stores_issued,
        backup_channels=record.backup_channels,
        reads_issued=record.reads_issued,
        lock_ref=record.lock_ref,
        load_slot=record.load_slot,
    )


def _permute_holders(
    holders: tuple[int, ...], mapping: PageMap, perm: tuple[int, ...]
) -> tuple[int, ...]:
    if _is_identity(mapping) and _is_identity(perm):
        return holders
    out = [FREE] * len(holders)
    for old, holder in enumerate(holders):
        out[mapping[old]] = _relabel_holder(holder, perm)
    return tuple(out)


def _relabel_holder(holder: int, perm: tuple[int, ...]) -> int:
    if holder == FREE:
        return FREE
    node = perm[holder_node(holder)]
    return node if holder >= 0 else -2 - node


def _permute_tags(
    tags: tuple[int, ...], mapping: PageMap, table: tuple[int, ...] | None, page_size: int
) -> tuple[int, ...]:
    if not _is_identity(mapping):
        out = list(tags)
        for old, new in enumerate(mapping):
            if old != new:
                start, source = new * page_size, old * page_size
                out[start : start + page_size] = tags[source : source + page_size]
        tags = tuple(out)
    if table is None:
        return tags
    return tuple(table[tag] for tag in tags)


def _relabel_event(event: EventName | None, perm: tuple[int, ...]) -> EventName | None:
    if event is None or event[0] not in NODE_EVENT_KINDS:
        return event
    return (event[0], perm[event[1]], event[2])


def _relabel_ack(ack: Ack, perm: tuple[int, ...]) -> Ack:
    return Ack(tuple(perm[n] for n in ack.node_ids), _relabel_event(ack.finish, perm), ack.slot)


def _relabel_op(
    op: StreamOp,
    perm: tuple[int, ...],
    device_map: PageMap,
    host_maps: list[list[PageMap]],
    config: OracleConfig,
) -> StreamOp:
    if isinstance(op, StoreKv):
        return StoreKv(perm[op.node], op.channel, tuple(device_map[p] for p in op.pages))
    if isinstance(op, ReadKv):
        return ReadKv(perm[op.node], op.channel, tuple(device_map[p] for p in op.pages))
    if isinstance(op, CopyPages):
        host = host_maps[_pool(config, op.channel)]
        pairs = tuple((r, host[r][h], device_map[d]) for r, h, d in op.pairs)
        return CopyPages(op.direction, op.channel, tuple(perm[n] for n in op.nodes), pairs)
    event = _relabel_event(op.event, perm)
    assert event is not None
    if isinstance(op, RecordEvent):
        return RecordEvent(event, op.seq)
    return WaitEvent(event, op.seq)
