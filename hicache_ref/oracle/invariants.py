"""``check_invariants(state)``: every invariant of ``specs/invariant_ids.txt`` the model can state.

Two sources, reported together: faults that a step recorded at the moment it happened (a read
before its layer landed, a D2H before its store, a free of a busy slot, an early drain), and
structural checks over the state below, one ``judge_*`` function per invariant id (the model's
own verdicts; the harness's checkers of an implementation are ``invariants/registry.py``'s
``check_inv_NN_*``). The checks never look at the protocol variant: a planted bug changes a step,
the checkers stay the same.
"""

from __future__ import annotations

from hicache_ref.oracle.config import LOAD, WRITE
from hicache_ref.oracle.geometry import (
    FREE,
    GARBAGE,
    compute_owned_positions,
    compute_token_tag,
    holder_node,
)
from hicache_ref.oracle.state import (
    HOST_RESIDENT,
    Ack,
    CopyPages,
    NodeState,
    OracleState,
    ReadKv,
    RecordEvent,
    StoreKv,
    Violation,
)
from hicache_ref.oracle.streams import has_pending_copy, has_pending_store

IN_FLIGHT = frozenset({"backup_in_flight", "load_queued", "load_in_flight"})


def check_invariants(state: OracleState) -> list[Violation]:
    """All violations in ``state``: recorded faults first, then the structural checks."""
    found = list(state.faults)
    for check in _CHECKS:
        found.extend(check(state))
    return found


def assert_invariants(state: OracleState) -> None:
    """Raise the first violation as ``InvariantViolation`` (for harnesses)."""
    found = check_invariants(state)
    if found:
        raise found[0].as_exception()


def is_quiescent(state: OracleState) -> bool:
    """No queued op, ack, queued load or pending per-layer write: the device and tree are idle."""
    return (
        not any(state.streams)
        and not any(state.write_acks)
        and not any(state.load_acks)
        and not any(state.load_queue)
        and not state.pending_layer_writes
    )


def judge_slot_conservation(state: OracleState) -> list[Violation]:
    """INV-05: holders and node records agree; no page held twice or by a stale node."""
    found: list[Violation] = []
    claimed: dict[tuple[int, int, int], int] = {}
    for node, record in enumerate(state.nodes):
        spans = [(-1, 0, record.device_pages)]
        spans += [(0, r, p) for r, p in enumerate(record.host_pages)]
        spans += [(1, r, p) for r, p in enumerate(record.draft_host_pages)]
        for pool, rank, pages in spans:
            for page in pages:
                key = (pool, rank, page)
                if key in claimed:
                    found.append(
                        _v("INV-05", f"page {key} claimed by nodes {claimed[key]} and {node}")
                    )
                claimed[key] = node
                holder = _holder(state, pool, rank, page)
                if holder_node(holder) != node:
                    found.append(
                        _v("INV-05", f"node {node} lists page {key} but its holder is {holder}")
                    )
    for key, holder in _all_holders(state):
        if holder != FREE and claimed.get(key) != holder_node(holder):
            found.append(_v("INV-05", f"page {key} held by {holder} that does not list it"))
    return found


def judge_no_host_free_in_flight(state: OracleState) -> list[Violation]:
    """INV-07: every host slot a queued copy uses is held by one of the copy's nodes."""
    found: list[Violation] = []
    layer_num = state.config.layer_num
    for queue in state.streams:
        for op in queue:
            if not isinstance(op, CopyPages):
                continue
            pool = 1 if op.channel >= layer_num else 0
            for rank, host_page, _ in op.pairs:
                holder = holder_node(state.host_holders[pool][rank][host_page])
                if holder not in op.nodes:
                    found.append(
                        _v(
                            "INV-07",
                            f"queued {op.direction} of channel {op.channel} for nodes {op.nodes} "
                            f"uses host page {host_page} (pool {pool}, rank {rank}) held by "
                            f"{holder}",
                        )
                    )
    return found


def judge_no_device_free_in_flight(state: OracleState) -> list[Violation]:
    """INV-08: every device page a queued store/read/copy uses is held by the op's node."""
    found: list[Violation] = []
    for queue in state.streams:
        for op in queue:
            if isinstance(op, StoreKv | ReadKv) and state.config.harness_schedule:
                continue  # a freed node's own forward work runs before any later user (FIFO)
            if isinstance(op, StoreKv | ReadKv):
                users: tuple[int, ...] = (op.node,)
                pages: tuple[int, ...] = op.pages
            elif isinstance(op, CopyPages):
                users, pages = op.nodes, tuple(d for _, _, d in op.pairs)
            else:
                continue
            for page in pages:
                holder = holder_node(state.device_holders[page])
                if holder not in users:
                    found.append(
                        _v(
                            "INV-08",
                            f"queued {type(op).__name__} for nodes {users} uses device page "
                            f"{page} held by {holder}",
                        )
                    )
    return found


def judge_single_write_ack(state: OracleState) -> list[Violation]:
    """INV-02: at most one undrained write ack per node id on every rank."""
    found: list[Violation] = []
    for rank, queue in enumerate(state.write_acks):
        ids = [node for ack in queue for node in ack.node_ids]
        for node in sorted({n for n in ids if ids.count(n) > 1}):
            found.append(
                _v(
                    "INV-02",
                    f"rank {rank} has {ids.count(node)} undrained write acks for node {node}",
                )
            )
    return found


def judge_owner_replay(state: OracleState) -> list[Violation]:
    """INV-03: a node's device pages are owned by the ranks its ``page_owners`` recorded."""
    config = state.config
    found: list[Violation] = []
    for node, record in enumerate(state.nodes):
        if record.page_owners and record.device_pages:
            owners = tuple(config.page_owner(p) for p in record.device_pages)
            if owners != record.page_owners:
                found.append(
                    _v(
                        "INV-03",
                        f"node {node} sits on device pages {record.device_pages} with owners "
                        f"{owners}, but page_owners recorded {record.page_owners}",
                    )
                )
    return found


def judge_layer_completeness(state: OracleState) -> list[Violation]:
    """INV-04: an ack follows every target and draft copy of its nodes, in its stream."""
    found: list[Violation] = []
    all_channels = tuple(range(state.config.num_channels))
    for queue in state.write_acks:
        for ack in queue:
            for node in ack.node_ids:
                record = state.nodes[node]
                if (
                    record.lifecycle == "backup_in_flight"
                    and record.backup_channels != all_channels
                ):
                    found.append(
                        _v(
                            "INV-04",
                            f"write ack for node {node} appended after channels "
                            f"{record.backup_channels} only; need {all_channels}",
                        )
                    )
            found.extend(_copies_after_finish(state, ack, WRITE, "d2h"))
    for queue in state.load_acks:
        for ack in queue:
            found.extend(_copies_after_finish(state, ack, LOAD, "h2d"))
    return sorted(set(found))


def _copies_after_finish(
    state: OracleState, ack: Ack, index: int, direction: str
) -> list[Violation]:
    queue = state.streams[index]
    finish = max(
        (i for i, op in enumerate(queue) if isinstance(op, RecordEvent) and op.event == ack.finish),
        default=-1,
    )
    found: list[Violation] = []
    for position, op in enumerate(queue):
        if isinstance(op, CopyPages) and position > finish and set(op.nodes) & set(ack.node_ids):
            found.append(
                _v(
                    "INV-04",
                    f"{direction} of channel {op.channel} for nodes {op.nodes} is queued after "
                    f"the finish event {ack.finish} of their ack (the ack completes too early)",
                )
            )
    return found


def judge_byte_equality(state: OracleState) -> list[Violation]:
    """INV-06: every settled device and host copy holds the tags of its node's KV."""
    found: list[Violation] = []
    for node, record in enumerate(state.nodes):
        for channel in _settled_device_channels(state, node, record):
            found.extend(_check_device_copy(state, node, record, channel))
        for channel in _settled_host_channels(state, node, record):
            found.extend(_check_host_copy(state, node, record, channel))
    return found


def _settled_device_channels(state: OracleState, node: int, record: NodeState) -> tuple[int, ...]:
    channels = range(state.config.num_channels)
    if record.lifecycle in ("device_only", "backup_in_flight", "backed_up"):
        return tuple(
            c for c in record.stores_issued if not has_pending_store(state.streams, node, c)
        )
    if record.lifecycle == "loaded":
        return tuple(channels)
    if record.lifecycle == "load_in_flight":
        return tuple(c for c in channels if not has_pending_copy(state.streams, node, c, "h2d"))
    return ()


def _settled_host_channels(state: OracleState, node: int, record: NodeState) -> tuple[int, ...]:
    if record.lifecycle in HOST_RESIDENT:
        return tuple(range(state.config.num_channels))
    if record.lifecycle == "backup_in_flight":
        return tuple(
            c for c in record.backup_channels if not has_pending_copy(state.streams, node, c, "d2h")
        )
    return ()


def _check_device_copy(
    state: OracleState, node: int, record: NodeState, channel: int
) -> list[Violation]:
    config = state.config
    ps = config.page_size
    tags = state.device_tags[channel]
    for position, page in enumerate(record.device_pages):
        for offset in range(ps):
            token = position * ps + offset
            if token >= config.node_tokens[node]:
                continue
            want = compute_token_tag(node, token, config.token_stride)
            got = tags[page * ps + offset]
            if got != want:
                return [
                    _v(
                        "INV-06",
                        f"device copy of node {node} channel {channel} token {token} (page "
                        f"{page}) holds tag {got}, expected {want} ({record.lifecycle})",
                    )
                ]
    return []


def _check_host_copy(
    state: OracleState, node: int, record: NodeState, channel: int
) -> list[Violation]:
    config = state.config
    ps = config.page_size
    draft = channel >= config.layer_num
    for rank, pages in enumerate(record.draft_host_pages if draft else record.host_pages):
        positions = compute_owned_positions(record.page_owners, rank)
        for host_page, position in zip(pages, positions, strict=True):
            for offset in range(ps):
                token = position * ps + offset
                if token >= config.node_tokens[node]:
                    continue
                want = compute_token_tag(node, token, config.token_stride)
                got = state.host_tags[channel][rank][host_page * ps + offset]
                if got != want:
                    what = "GARBAGE" if got == GARBAGE else str(got)
                    return [
                        _v(
                            "INV-06",
                            f"host copy of node {node} channel {channel} token {token} (rank "
                            f"{rank}, host page {host_page}) holds {what}, expected {want} "
                            f"({record.lifecycle})",
                        )
                    ]
    return []


def judge_producer_slots(state: OracleState) -> list[Violation]:
    """INV-10: undrained load acks use distinct producer slots, at most ``num_counters``."""
    found: list[Violation] = []
    limit = state.config.num_counters
    for rank, queue in enumerate(state.load_acks):
        slots = [ack.slot for ack in queue]
        if len(slots) != len(set(slots)) or len(slots) > limit:
            found.append(
                _v(
                    "INV-10",
                    f"rank {rank} has undrained load acks on producer slots {slots} (limit {limit})",
                )
            )
    return found


def judge_cp_ack_rows(state: OracleState) -> list[Violation]:
    """INV-14: every rank's write acks, load acks and load queue carry the same node ids."""
    found: list[Violation] = []
    for name, rows in (
        ("ack_write_queue", [tuple(a.node_ids for a in q) for q in state.write_acks]),
        ("ack_load_queue", [tuple(a.node_ids for a in q) for q in state.load_acks]),
        ("load_queue", [tuple(q) for q in state.load_queue]),
    ):
        for rank, row in enumerate(rows[1:], start=1):
            if row != rows[0]:
                found.append(_v("INV-14", f"{name} of rank {rank} is {row}, rank 0 has {rows[0]}"))
    return found


def judge_cancel_quiesces(state: OracleState) -> list[Violation]:
    """INV-15: a cancelled node gets no later write ack, D2H or pending layer state."""
    found: list[Violation] = []
    for node in state.cancelled:
        if any(node in a.node_ids for q in state.write_acks for a in q):
            found.append(_v("INV-15", f"write ack appended for node {node} after its cancel"))
        if has_pending_copy(state.streams, node, None, "d2h"):
            found.append(_v("INV-15", f"a D2H for node {node} is still queued after its cancel"))
        if any(p.node == node for p in state.pending_layer_writes):
            found.append(_v("INV-15", f"node {node} keeps a pending layer write after its cancel"))
    return found


def judge_acked_once_at_quiescence(state: OracleState) -> list[Violation]:
    """INV-16: at quiescence no node waits for an ack and no lock is left behind."""
    if not is_quiescent(state):
        return []
    found: list[Violation] = []
    for node, record in enumerate(state.nodes):
        if record.lifecycle in IN_FLIGHT or record.lock_ref != 0:
            found.append(
                _v(
                    "INV-16",
                    f"quiescent, but node {node} is {record.lifecycle} with lock_ref "
                    f"{record.lock_ref} (an ack was lost or appended twice)",
                )
            )
    return found


def judge_reset_clean(state: OracleState) -> list[Violation]:
    """INV-18: right after reset nothing is queued, acked, pending, counted or held."""
    if not state.fresh_epoch:
        return []
    leftovers = {
        "streams": any(state.streams),
        "ack_write_queue": any(state.write_acks),
        "ack_load_queue": any(state.load_acks),
        "load_queue": any(state.load_queue),
        "pending_layer_writes": bool(state.pending_layer_writes),
        "producer_index": state.producer_index != -1,
        "held pages": any(h != FREE for _, h in _all_holders(state)),
    }
    return [
        _v("INV-18", f"after reset {name} is not empty") for name, bad in leftovers.items() if bad
    ]


_CHECKS = (
    judge_slot_conservation,
    judge_single_write_ack,
    judge_owner_replay,
    judge_layer_completeness,
    judge_byte_equality,
    judge_no_host_free_in_flight,
    judge_no_device_free_in_flight,
    judge_producer_slots,
    judge_cp_ack_rows,
    judge_cancel_quiesces,
    judge_acked_once_at_quiescence,
    judge_reset_clean,
)


def _v(inv_id: str, message: str) -> Violation:
    return Violation(inv_id, message)


def _holder(state: OracleState, pool: int, rank: int, page: int) -> int:
    if pool < 0:
        return state.device_holders[page]
    return state.host_holders[pool][rank][page]


def _all_holders(state: OracleState) -> list[tuple[tuple[int, int, int], int]]:
    pairs = [((-1, 0, p), h) for p, h in enumerate(state.device_holders)]
    for pool, per_rank in enumerate(state.host_holders):
        for rank, holders in enumerate(per_rank):
            pairs.extend(((pool, rank, p), h) for p, h in enumerate(holders))
    return pairs
