"""The tree's half of buffer mode: host pages as staging, beliefs of what L3 holds (our code).

In ``buffer_only`` host memory (``HarnessConfig.storage_buffer_only``) upstream's unified radix
cache hands its two transfer pipelines to a ``BufferModePipeline``. The harness models the part
of it that owns the storage protocol around the controller, on each rank, in the order a page
meets it:

- ``covered``: a write whose pages every rank believes stored, or in flight, is skipped (the
  pipeline's admission, ``_pool_covered``: one redundant write less);
- ``launch``: a write's host pages are staging: its keys go in flight in the beliefs
  (``track_inflight``) and its tokens into the write staging the controller's rate limit leaves
  out (``host_write_staged_tokens_fn``; ``rate_limited`` records each verdict of it with the
  host pages in use then);
- ``storage_ack``: at the drained storage ack its pages are taught unconditionally (a write the
  backend failed is a stale positive until a query heals it: upstream's design, for TP
  determinism), the in-flight ref dropped, the staging freed (the storage driver frees the
  write's host pages at every ack);
- ``queried`` then ``hit``: a drained hit query heals the beliefs from the controller's
  rank-agreed verdict: pages past it are forgotten (0.5.22+: the KV pool's
  ``query_pool_hit_pages``, and pages up to it learnt; 0.5.19 - 0.5.21: the folded hit);
- ``fetched``: a completed fetch teaches the pages it delivered;
- ``reset`` drops what is in flight; ``clear`` (the clear endpoint, every rank) forgets all.

Each rank's beliefs are the tree's own class (upstream's ``StorageExistenceCache``, handed by
the controller as ``harness_beliefs``, ``adapters/sglang_buffer.py``; the reference's own
``StorageExistenceBeliefs``, ``adapters/reference_beliefs.py``), driven as the pipeline
drives it. Beside it the book keeps the harness's own record of the same world: the keys an
acked write or an agreed hit taught and no drained query found missing since, with the verdict
taken from what each rank's backend answered (the recording backend's calls), never from the
controller; and the writes in flight. ``views`` hands both to INV-41.

Not modelled: the D2H leg of a backup (the storage world fills a chain's staging directly, so a
write is launched and its D2H acked at once), the parent-cover gate, the read path's load back
(a fetched chain becomes a host node as in cache mode), pools other than the KV pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hicache_ref.invariants.storage_snapshot import BeliefView


class BeliefsLike(Protocol):
    """One rank's storage existence beliefs (the tree's class), as the pipeline calls it."""

    def covered(self, keys: Sequence[str]) -> bool: ...
    def track_inflight(self, keys: Sequence[str]) -> None: ...
    def finish_storage_write_ack(self, keys: Sequence[str]) -> None: ...
    @property
    def learns_at_query(self) -> bool: ...
    def heal_from_query(self, operation: Any, page_size: int) -> None: ...
    def stage_completed_prefetch(self, keys: Sequence[str]) -> None: ...
    def clear(self) -> None: ...
    def clear_inflight(self) -> None: ...
    def view(self) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]: ...


@dataclass
class RankBuffer:
    """One rank's pipeline state: its tree's beliefs and the harness's record beside them."""

    beliefs: BeliefsLike
    taught: set[str] = field(default_factory=set)
    refuted: set[str] = field(default_factory=set)
    launched: Counter[str] = field(default_factory=Counter)
    writes: dict[int, tuple[list[str], int]] = field(default_factory=dict)  # op -> keys, tokens
    staged_tokens: int = 0
    chains: dict[str, list[str]] = field(default_factory=dict)  # prefetch -> its page keys
    host_pool: Any = None  # the rank's host pool (the harness's own)
    admission: tuple[bool, int, int, int] | None = None  # the controller's last rate-limit
    # verdict, with the host tokens in use, the write staging and the pool's size then
    verdicts: dict[str, int | None] = field(default_factory=dict)  # prefetch -> pages found

    def learn(self, keys: Sequence[str]) -> None:
        self.taught.update(keys)
        self.refuted.difference_update(keys)


class BufferBook:
    """Every rank's buffer pipeline of one storage world."""

    def __init__(self, ranks: list[RankBuffer], controllers: Sequence[Any], page: int) -> None:
        self.ranks = ranks
        self.controllers = list(controllers)
        self.page = page

    @classmethod
    def of(cls, storage_ranks: Sequence[Any], page: int) -> BufferBook:
        """The book of a ``buffer_only`` world: each rank's controller carries its tree's
        beliefs (``harness_beliefs``) and reads the tree's write staging through
        ``host_write_staged_tokens_fn`` (its rate limit leaves it out)."""
        ranks = []
        controllers = [r.controller for r in storage_ranks]
        for cc, storage_rank in zip(controllers, storage_ranks, strict=True):
            beliefs = getattr(cc, "harness_beliefs", None)
            if beliefs is None:
                raise ValueError(
                    f"{type(cc).__name__} has no harness_beliefs: a storage_buffer_only world "
                    "needs an implementation with capability storage:buffer_only"
                )
            rank = RankBuffer(beliefs, host_pool=storage_rank.host_pool)
            cc.host_write_staged_tokens_fn = lambda rank=rank: rank.staged_tokens
            ranks.append(rank)
        return cls(ranks, controllers, page)

    def chain_keys(self, tokens: list[int], prior: str | None, page: int) -> list[list[str]]:
        """Each rank's page keys of ``tokens`` after ``prior``, with the tree's own hash (the
        keys a write stores and a query asks)."""
        return [cc._harness_page_keys(tokens, prior, page) for cc in self.controllers]

    # -- the write path ------------------------------------------------------------------------
    def covered(self, keys: Sequence[Sequence[str]]) -> bool:
        """Every rank believes each page of its keys stored or in flight: the write is skipped."""
        return all(r.beliefs.covered(k) for r, k in zip(self.ranks, keys, strict=True))

    def launch(self, rank: int, op_id: int, keys: Sequence[str], tokens: int) -> None:
        state = self.ranks[rank]
        state.beliefs.track_inflight(keys)
        state.launched.update(keys)
        state.writes[op_id] = (list(keys), tokens)
        state.staged_tokens += tokens

    def storage_ack(self, rank: int, op_id: int) -> None:
        """``finish_storage_write_ack``: taught whatever the backend did, staging freed."""
        state = self.ranks[rank]
        write = state.writes.pop(op_id, None)
        if write is None:
            return  # not this pipeline's (an earlier epoch's)
        keys, tokens = write
        state.beliefs.finish_storage_write_ack(keys)
        state.learn(keys)
        state.launched.subtract(keys)
        state.launched = +state.launched  # drop the keys whose refs reached zero
        state.staged_tokens -= tokens

    # -- the read path -------------------------------------------------------------------------
    def rate_limited(self, verdicts: Sequence[bool]) -> None:
        """The controller's ``prefetch_rate_limited`` on each rank, with the host pages in use
        then (the harness's own pool), for INV-41 to judge against the write staging."""
        for state, limited in zip(self.ranks, verdicts, strict=True):
            size = int(state.host_pool.size)
            used = size - int(state.host_pool.available_size())
            state.admission = (bool(limited), used, state.staged_tokens, size)

    def expect(self, rank: int, rid: str, keys: Sequence[str]) -> None:
        """A prefetch's page keys on ``rank`` (the tree's chain after its last hash)."""
        self.ranks[rank].chains[rid] = list(keys)

    def queried(self, rank: int, rid: str, pages: int | None) -> None:
        """What ``rank``'s backend answered the hit query: the leading pages it holds (None:
        the query did not run to an answer, so the rank hands no verdict)."""
        self.ranks[rank].verdicts[rid] = pages

    def hit(self, rank: int, operation: Any) -> None:
        """The tree drained a hit (``_invalidate_absent_from_hit_query``): the class heals as
        its release does, the record from what every rank's backend answered: 0.5.22+ only with
        every rank's answer (a rank without one hands no verdict, so the MIN carries none), up
        to it learnt and past it forgotten; 0.5.19 - 0.5.21 on a rank that queried, past the
        folded hit (a rank without an answer counts none) forgotten."""
        if getattr(operation, "deadline_expired", False):
            return  # a cut query's agreed hit is no verdict
        state = self.ranks[rank]
        state.beliefs.heal_from_query(operation, self.page)
        rid = str(operation.request_id)
        found = [r.verdicts.get(rid) for r in self.ranks]
        keys = state.chains.get(rid)
        learns = state.beliefs.learns_at_query
        if keys is None or (None in found if learns else found[rank] is None):
            return
        agreed = min(pages or 0 for pages in found)
        state.taught.difference_update(keys[agreed:])
        state.refuted.update(keys[agreed:])
        if learns:
            state.learn(keys[:agreed])

    def fetched(self, rank: int, rid: str, pages: int) -> None:
        """A completed fetch of ``pages`` pages (``stage_completed_prefetch``)."""
        state = self.ranks[rank]
        keys = state.chains.get(rid, [])[:pages]
        state.beliefs.stage_completed_prefetch(keys)
        state.learn(keys)

    # -- reset, clear, evidence ----------------------------------------------------------------
    def reset(self) -> None:
        """The dropped writes reach no storage ack: nothing is in flight or staged."""
        for state in self.ranks:
            state.beliefs.clear_inflight()
            state.launched.clear()
            state.writes.clear()
            state.staged_tokens = 0
            state.chains.clear()
            state.verdicts.clear()

    def clear(self) -> None:
        """L3 is empty now: every belief is stale (every rank's clear endpoint)."""
        for state in self.ranks:
            state.beliefs.clear()
            state.taught.clear()
            state.refuted.clear()
            state.launched.clear()

    def views(self) -> tuple[BeliefView, ...]:
        views = []
        for rank, state in enumerate(self.ranks):
            believed, inflight = state.beliefs.view()
            views.append(
                BeliefView(
                    rank,
                    believed,
                    inflight,
                    tuple(sorted(state.taught)),
                    tuple(sorted(state.launched.items())),
                    tuple(sorted(state.refuted)),
                    state.staged_tokens,
                    state.admission,
                )
            )
        return tuple(views)
