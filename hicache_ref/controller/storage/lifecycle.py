"""The two slow parts of a detach: letting every queued operation reach its final ack, and
closing the backend (best effort: a backend that fails to close is logged, never fatal)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hicache_ref.controller.storage.executor import STORAGE_JOIN_TIMEOUT_S
from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorage

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import DetachTier

logger = logging.getLogger("hicache_ref.controller.storage")
IDLE_POLL_S = 0.002


def finish_pending_work(tier: DetachTier) -> None:
    """Run (manual) or wait for (threads) every queued step, so each op reaches its final ack
    (INV-24: detach leaves no operation in flight)."""
    if tier.executor.name == "thread":
        deadline = time.monotonic() + STORAGE_JOIN_TIMEOUT_S
        while tier.has_any_work():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"detach: storage work {tier.queues.sizes()} did not finish within "
                    f"{STORAGE_JOIN_TIMEOUT_S:g} s; detach aborted"
                )
            time.sleep(IDLE_POLL_S)
        return
    if not tier.has_any_work():
        return
    if tier.collectives.world_size > 1:
        raise HiCacheInputError(
            f"detach with storage work queued {tier.queues.sizes()} on rank "
            f"{tier.rank} of a {tier.collectives.world_size}-rank manual world: run every "
            "rank's steps until idle first (lockstep.run_until_idle), then detach"
        )
    tier.run_until_idle()


def close_backend(backend: HiCacheStorage | None) -> None:
    if backend is None:
        return
    try:
        backend.close()
    except Exception:
        logger.exception("failed to close storage backend cleanly")
