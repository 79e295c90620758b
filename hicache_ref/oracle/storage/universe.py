"""A universe that grows: the keys and operations a harness adds as a case goes on.

The exhaustive checker's worlds are fixed (``StorageConfig.ops``, a chain of ``pages`` keys). A
harness in lockstep does not know its operations in advance: each ``write_storage`` or
``prefetch`` it issues adds one ``OpSpec`` and any key it has not seen before (each with the key
its chain puts before it), and every rank's state grows with them: new keys absent from L3, the
new op not issued. Nothing already in the state changes, so a trace replays the same way in the
grown world.
"""

from __future__ import annotations

from dataclasses import replace

from hicache_ref.oracle.state import evolve
from hicache_ref.oracle.storage.config import OpKind, OpSpec, StorageConfig
from hicache_ref.oracle.storage.state import ABSENT, BackupView, PrefetchView, StorageState


def growing_config(
    ranks: int, batch_pages: int, page_points: bool = False, lock_points: bool = False
) -> StorageConfig:
    """An empty world that grows (no key, no op yet), with unbounded fault and reset budgets
    (a harness's faults and resets are what happened, not what the checker may choose)."""
    return StorageConfig(
        page_points=page_points,
        lock_points=lock_points,
        ranks=ranks,
        pages=0,
        batch_pages=batch_pages,
        ops=(),
        grows=True,
        max_faults=UNBOUNDED,
        max_resets=UNBOUNDED,
        detach=True,
        clear=True,
    )


UNBOUNDED = 1 << 60


def add_key(state: StorageState, parent: int) -> tuple[StorageState, int]:
    """One more key, after ``parent`` in its chain (-1: a chain's head); returns its id."""
    config = state.config
    grown = replace(config, pages=config.pages + 1, key_parents=(*config.key_parents, parent))
    ranks = tuple(evolve(r, l3=(*r.l3, ABSENT)) for r in state.ranks)
    return evolve(state, config=grown, ranks=ranks), config.pages


def add_op(state: StorageState, kind: OpKind, keys: tuple[int, ...]) -> tuple[StorageState, int]:
    """One more operation over existing ``keys``; returns its index (what ``Prefetch`` /
    ``WriteStorage`` name)."""
    config = state.config
    spec = OpSpec(kind, len(keys), keys)
    grown = replace(config, ops=(*config.ops, spec))
    ranks = tuple(
        evolve(r, prefetches=(*r.prefetches, PrefetchView()), backups=(*r.backups, BackupView()))
        for r in state.ranks
    )
    return evolve(state, config=grown, ranks=ranks), len(config.ops)
