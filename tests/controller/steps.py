"""Story steps shared by the refusal tests: a node written, backed up, reserved; a refusal.

``refused(rig, call, error, match)`` is the core check of these files: the call raises the typed
error whose message names the rule, and the device allocator, the host pools and the
controller's queues are exactly as before (INV-17).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache_ref.device import SimDevice
from hicache_ref.invariants.models import HiCacheWriteReservation
from hicache_ref.pools import CpSharedKVLayout

from .rig import Rig, build_rig, drain_acks, fill_node, snapshot

PAGE = 4


def sim_of(rig: Rig) -> SimDevice:
    assert isinstance(rig.device, SimDevice)
    return rig.device


def alloc(rig: Rig, tokens: int) -> torch.Tensor:
    locs = rig.allocator.alloc(tokens)
    assert locs is not None
    return locs


def written(rig: Rig, node_id: int, pages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A node whose write was issued (not run): its device locs and host slots."""
    locs = alloc(rig, pages * PAGE)
    fill_node(rig.device_pool, locs, node_id)
    host = rig.controller.write(locs, node_id=node_id)
    assert isinstance(host, torch.Tensor)
    return locs, host


def backed_up(rig: Rig, node_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A node whose write landed and whose ack was drained."""
    locs, host = written(rig, node_id)
    sim_of(rig).run_until_idle()
    drain_acks(rig.controller.ack_write_queue)
    return locs, host


def cp_rig(**kwargs: Any) -> Rig:
    return build_rig(SimDevice(), kind="nsa", cp_layout=CpSharedKVLayout(1, 0, PAGE), **kwargs)


def reserve(rig: Rig, locs: torch.Tensor, node_id: int) -> HiCacheWriteReservation:
    reservation = rig.controller.reserve_write_cp(locs, node_id=node_id)
    assert isinstance(reservation, HiCacheWriteReservation)
    return reservation


def refused(
    rig: Rig, call: Callable[[], object], error: type[BaseException], match: str
) -> BaseException:
    """``call`` raises ``error`` matching ``match`` and leaves pools and queues as they were."""
    before = snapshot(rig)
    with pytest.raises(error, match=match) as caught:
        call()
    assert snapshot(rig) == before
    return caught.value
