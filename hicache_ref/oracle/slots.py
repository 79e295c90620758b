"""Allocating and freeing device pages and host slots, with the in-flight guards.

Freeing is where INV-07/INV-08 bugs happen, so the guards live here and run whatever the
protocol variant says: a page is never freed while a queued op still uses it or while an
undrained ack names its node. Freed pages are wiped to ``GARBAGE``, so every free page is
interchangeable with every other of its class (the bounded checker's symmetry reduction).
"""

from __future__ import annotations

from hicache_ref.errors import HiCacheInputError
from hicache_ref.oracle.config import FORWARD
from hicache_ref.oracle.geometry import (
    FREE,
    GARBAGE,
    alloc_lowest_free,
    compute_owned_positions,
    compute_page_slots,
    is_owned_holder,
    set_holders,
)
from hicache_ref.oracle.state import (
    CopyPages,
    OracleState,
    ReadKv,
    StoreKv,
    evolve,
    replace_at,
    with_fault,
)

RankPages = tuple[tuple[int, ...], ...]
"""One tuple of pages per rank."""


def compute_host_demand(owners: tuple[int, ...], num_ranks: int) -> tuple[int, ...]:
    """How many host pages each rank needs for a node whose pages have ``owners``.

    pre: num_ranks >= 1
    post: len(__return__) == num_ranks
    post: sum(__return__) == sum(1 for o in owners if 0 <= o < num_ranks)
    """
    return tuple(len(compute_owned_positions(owners, rank)) for rank in range(num_ranks))


def choose_host_pages(
    holders: tuple[tuple[int, ...], ...], demand: tuple[int, ...], explicit: RankPages | None
) -> RankPages | None:
    """Host pages per rank for ``demand``: the explicit ones (validated) or the lowest free.

    Returns None on a shortfall of any rank (nothing is allocated then, INV-17).
    """
    if explicit is None:
        chosen = tuple(alloc_lowest_free(holders[r], n) for r, n in enumerate(demand))
        if any(pages is None for pages in chosen):
            return None
        return tuple(pages for pages in chosen if pages is not None)
    # Verify the caller's pages fit the demand and are free (misuse, not a protocol bug)
    if len(explicit) != len(demand) or any(
        len(p) != n for p, n in zip(explicit, demand, strict=True)
    ):
        raise HiCacheInputError(
            f"explicit host pages {explicit} do not match the per-rank demand {demand}"
        )
    for rank, pages in enumerate(explicit):
        if len(set(pages)) != len(pages) or any(
            not 0 <= p < len(holders[rank]) or holders[rank][p] != FREE for p in pages
        ):
            raise HiCacheInputError(
                f"explicit host pages {pages} of rank {rank} are not distinct free pages"
            )
    return explicit


def assign_host_pages(state: OracleState, pool: int, pages: RankPages, holder: int) -> OracleState:
    """Set the holder of every page in ``pages`` of host pool ``pool``."""
    per_rank = tuple(
        set_holders(state.host_holders[pool][rank], pages[rank], holder)
        for rank in range(len(pages))
    )
    return evolve(state, host_holders=replace_at(state.host_holders, pool, per_rank))


def check_device_pages(state: OracleState, pages: tuple[int, ...], count: int) -> None:
    """Verify explicit device pages are ``count`` distinct free pages (else misuse)."""
    if (
        len(pages) != count
        or len(set(pages)) != count
        or any(
            not 0 <= p < len(state.device_holders) or state.device_holders[p] != FREE for p in pages
        )
    ):
        raise HiCacheInputError(
            f"explicit device pages {pages} are not {count} distinct free device pages"
        )


def free_device_pages(state: OracleState, node: int) -> OracleState:
    """Free ``node``'s device pages and wipe their content; guard INV-05 and INV-08."""
    pages = state.nodes[node].device_pages
    for page in pages:
        # Verify the page belongs to the node being freed (INV-05: no foreign or double free)
        if not is_owned_holder(state.device_holders[page], node):
            state = with_fault(
                state,
                "INV-05",
                f"evict_device(node={node}) frees device page {page} held by "
                f"{state.device_holders[page]} (double or foreign free)",
            )
    # Verify no queued op still uses the pages (INV-08, bug class 10); under the harness's
    # schedule queued forward work may still use them (the forward stream is FIFO, and every
    # later user of the pages, a store, a fenced copy, is ordered after it)
    relaxed = state.config.harness_schedule
    own = _forward_pages(state) if relaxed else set()
    busy = _device_pages_in_use(state, set(pages), skip_forward=relaxed)
    if busy:
        state = with_fault(
            state,
            "INV-08",
            f"device pages {sorted(busy)} of node {node} freed while a queued "
            f"store/read/copy still uses them (wait for its ack)",
        )
    # Verify no undrained load ack still pins the node (INV-08)
    if any(node in ack.node_ids for queue in state.load_acks for ack in queue):
        state = with_fault(
            state,
            "INV-08",
            f"device pages of node {node} freed while its load ack is undrained",
        )
    holders = set_holders(state.device_holders, pages, FREE)
    wiped = tuple(p for p in pages if p not in own)  # queued stores/reads still see them
    slots = tuple(s for p in wiped for s in compute_page_slots(p, state.config.page_size))
    tags = tuple(_wipe(per_channel, slots) for per_channel in state.device_tags)
    return evolve(state, device_holders=holders, device_tags=tags)


def free_host_pages(state: OracleState, node: int) -> OracleState:
    """Free ``node``'s target and draft host pages and wipe them; guard INV-05 and INV-07."""
    record = state.nodes[node]
    for pool, rank_pages in enumerate((record.host_pages, record.draft_host_pages)):
        for rank, pages in enumerate(rank_pages):
            for page in pages:
                # Verify the slot belongs to the node being freed (INV-05)
                if not is_owned_holder(state.host_holders[pool][rank][page], node):
                    state = with_fault(
                        state,
                        "INV-05",
                        f"evict_host(node={node}) frees host page {page} (pool {pool}, rank "
                        f"{rank}) held by {state.host_holders[pool][rank][page]}",
                    )
            # Verify no queued copy still reads or writes these host slots (INV-07)
            busy = _host_pages_in_use(state, pool, rank, set(pages))
            if busy:
                state = with_fault(
                    state,
                    "INV-07",
                    f"host pages {sorted(busy)} (pool {pool}, rank {rank}) of node {node} "
                    f"freed while a queued copy still uses them (synchronize or drain first)",
                )
            state = assign_host_pages(state, pool, _only_rank(rank, pages, len(rank_pages)), FREE)
            state = _wipe_host(state, pool, rank, pages)
    # Verify no undrained ack names the node (INV-07, bug class 4)
    queues = (*state.write_acks, *state.load_acks)
    if any(node in ack.node_ids for queue in queues for ack in queue):
        state = with_fault(
            state,
            "INV-07",
            f"host slots of node {node} freed while an ack naming it is undrained "
            f"(drain the ack before evict_host)",
        )
    return state


def _only_rank(rank: int, pages: tuple[int, ...], ranks: int) -> RankPages:
    return tuple(pages if r == rank else () for r in range(ranks))


def _wipe(tags: tuple[int, ...], slots: tuple[int, ...]) -> tuple[int, ...]:
    if not slots:
        return tags
    wiped = list(tags)
    for slot in slots:
        wiped[slot] = GARBAGE
    return tuple(wiped)


def _wipe_host(state: OracleState, pool: int, rank: int, pages: tuple[int, ...]) -> OracleState:
    config = state.config
    slots = tuple(s for p in pages for s in compute_page_slots(p, config.page_size))
    channels = (
        range(config.layer_num) if pool == 0 else range(config.layer_num, config.num_channels)
    )
    host_tags = state.host_tags
    for channel in channels:
        per_rank = replace_at(host_tags[channel], rank, _wipe(host_tags[channel][rank], slots))
        host_tags = replace_at(host_tags, channel, per_rank)
    return evolve(state, host_tags=host_tags)


def _forward_pages(state: OracleState) -> set[int]:
    """Device pages that queued forward stores and reads still use."""
    return {
        page
        for op in state.streams[FORWARD]
        if isinstance(op, StoreKv | ReadKv)
        for page in op.pages
    }


def _device_pages_in_use(
    state: OracleState, pages: set[int], skip_forward: bool = False
) -> set[int]:
    busy: set[int] = set()
    for queue in state.streams:
        for op in queue:
            if isinstance(op, StoreKv | ReadKv):
                if not skip_forward:
                    busy.update(pages.intersection(op.pages))
            elif isinstance(op, CopyPages):
                busy.update(pages.intersection(d for _, _, d in op.pairs))
    return busy


def _host_pages_in_use(state: OracleState, pool: int, rank: int, pages: set[int]) -> set[int]:
    layer_num = state.config.layer_num
    busy: set[int] = set()
    for queue in state.streams:
        for op in queue:
            if isinstance(op, CopyPages) and (op.channel >= layer_num) == (pool == 1):
                busy.update(h for r, h, _ in op.pairs if r == rank and h in pages)
    return busy
