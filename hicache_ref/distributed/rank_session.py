"""One CP rank's ``Session`` in its own process: a world holding only that rank.

The lockstep harness keeps every CP rank in one process, and three things of it assume so:

- ``Session`` builds every rank by default; here it is handed a builder of a world holding
  that rank alone (``DeviceWorlds(only_ranks=(rank,))``, on a GPU with the rank's own device);
- the tree's model indexes per-rank holdings by *position* in ``world.ranks`` while snapshots
  carry the rank's *id* (``registry.check_inv_05_slot_conservation`` indexes holdings by position), so
  a lone rank 2 would index past its one entry: ``_RankImplementation.snapshot`` labels the
  snapshot with its position (0) and the verdict names the real rank;
- the tree drains ``MIN(ready)`` acks over the ranks it holds; across processes the minimum is
  a collective, agreed before the step (``agreement.py``) and enforced here by
  ``DrainAgreement``, which caps the tree's ready count for the step.

Everything else of the tree already works per rank through the rank's own ``cp_layout``
(owned positions, physical locs, host slot counts, byte checks on owned pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_ref.harness.adapters.base import (
    AckQueue,
    BuildRequest,
    ControllerLike,
    Implementation,
    RankLike,
)
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import DeviceWorlds, HarnessDevice
from hicache_ref.invariants.snapshot import RankSnapshot

ACK_QUEUES = ("ack_write_queue", "ack_load_queue")
READY_PREFIX_SEAM = "_ready_prefix"
"""The tree's ``MIN(ready)`` over the ranks it holds (``TreeDriver._ready_prefix``): the one
private name this package relies on; a public ``TreeDriver`` hook would replace it."""


class _RankImplementation:
    """The implementation under test, its snapshots labelled by position in a one-rank world."""

    def __init__(self, inner: Implementation) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.source_tree = inner.source_tree
        self._snapshot = inner.snapshot  # contract: optional hook

    def build_controller(self, request: BuildRequest) -> ControllerLike:
        return self.inner.build_controller(request)

    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot:
        snap: RankSnapshot = self._snapshot(rank, gate_ids)
        return dataclasses.replace(snap, rank=0)

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        return self.inner.refine_config(config)

    def __getattr__(self, name: str) -> Any:  # controller_class, focus, ...
        return getattr(self.inner, name)


def get_ready_prefix(controller: ControllerLike, queue_name: str) -> int:
    """How many leading acks of one of the rank's queues have completed (the FIFO prefix)."""
    queue: AckQueue = getattr(controller, queue_name)
    count = 0
    for ack in queue:
        if not ack.finish_event.query():
            break
        count += 1
    return count


class DrainAgreement:
    """Caps the tree's ready count per queue at what every rank agreed on for this step."""

    def __init__(self, tree: TreeDriver, controller: ControllerLike) -> None:
        if not callable(getattr(tree, READY_PREFIX_SEAM, None)):
            raise RuntimeError(
                f"TreeDriver has no {READY_PREFIX_SEAM}(queue_name) -> int: a CP world across "
                "processes needs the tree's MIN(ready) drain count as a seam to agree on"
            )
        self.controller = controller
        self.caps: dict[str, int] = {}
        tree.__dict__[READY_PREFIX_SEAM] = self.ready_prefix  # shadows the method: one rank

    def local(self) -> tuple[int, int]:
        """This rank's ready prefix of (write acks, load acks) now."""
        write, load = (get_ready_prefix(self.controller, q) for q in ACK_QUEUES)
        return write, load

    def agree(self, ready: Sequence[tuple[int, int]]) -> None:
        """Drain at most MIN over ranks of each queue's ready prefix during the next step."""
        self.caps = {q: min(r[i] for r in ready) for i, q in enumerate(ACK_QUEUES)}

    def release(self) -> None:
        self.caps = {}

    def ready_prefix(self, queue_name: str) -> int:
        local = get_ready_prefix(self.controller, queue_name)
        cap = self.caps.get(queue_name)
        return local if cap is None else min(local, cap)


@dataclass
class RankSession:
    """A ``Session`` over one CP rank, and the drain agreement installed on its tree."""

    rank: int
    world_size: int
    session: Session
    drains: DrainAgreement

    @property
    def config(self) -> HarnessConfig:
        return self.session.config


def open_rank_session(
    config: HarnessConfig,
    implementation: Implementation,
    impl_name: str,
    rank: int,
    *,
    device: HarnessDevice | None = None,
) -> RankSession:
    """The session of ``rank`` alone, for a process of a CP world of ``config.cp_size`` ranks."""
    assert config.uses_cp, "a CP world across processes needs cp_size >= 1"
    assert 0 <= rank < config.num_ranks, f"rank {rank} outside [0, {config.num_ranks})"
    factory = None if device is None else (lambda config: device)
    build = DeviceWorlds(factory, only_ranks=(rank,))  # a world of this rank alone
    session = Session(config, _RankImplementation(implementation), impl_name, build=build)
    ranks = session.world.ranks
    assert [r.rank for r in ranks] == [rank], f"the session built ranks {[r.rank for r in ranks]}"
    drains = DrainAgreement(session.tree, ranks[0].controller)
    return RankSession(rank, config.num_ranks, session, drains)
