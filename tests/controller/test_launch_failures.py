"""A copy that fails to launch leaves nothing behind, and the retry round-trips the bytes.

A fault is injected on the k-th launch, either in the device (``launch`` raises) or in a host
pool (its copy method raises). The call raises one ``TransferLaunchError`` whose cause is the
fault, and the controller's observable state is exactly as before the call: op and ack queues
(the same op objects), the producer index, the in-flight tracker, the pending per-layer writes
with their progress, and the allocator's and host pools' pages (what the call allocated is
freed). No copy of the failed call is left queued. Once the fault is removed, the same call
succeeds and the bytes round-trip (INV-06).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hicache_ref.device import CudaDevice, SimDevice, cuda_available
from hicache_ref.device.protocol import OpKind
from hicache_ref.errors import HiCacheFault, HiCacheInputError, TransferLaunchError
from hicache_ref.invariants.models import HiCacheWriteReservation, HiCacheWriteResult
from hicache_ref.pools import CpSharedKVLayout

from .rig import Rig, Snapshot, ack_rows, assert_rows, build_rig, drain_acks, fill_node, snapshot
from .round_trips import HeldWriteController
from .steps import PAGE, alloc

FAULT = "injected launch fault"


class FaultyDevice(SimDevice):
    """A SimDevice whose ``fail_at``-th copy launch (counted from arming) raises."""

    fail_at: int | None = None
    copies = 0

    def arm(self, k: int) -> None:
        self.fail_at, self.copies = k, 0

    def disarm(self) -> None:
        self.fail_at = None

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        if kind == "copy" and self.fail_at is not None:
            self.copies += 1
            if self.copies == self.fail_at:
                raise RuntimeError(f"{FAULT} ({label})")
        super().launch(fn, label=label, kind=kind, meta=meta)


def fail_on_call(
    obj: Any, method: str, k: int, error: Exception | None = None
) -> Callable[[], None]:
    """Make ``obj.method`` raise on its k-th call from now; returns the function that heals it."""
    original = getattr(obj, method)
    calls = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            raise error if error is not None else RuntimeError(f"{FAULT} ({method})")
        return original(*args, **kwargs)

    setattr(obj, method, faulty)
    return lambda: delattr(obj, method)


@dataclass(frozen=True)
class ControllerView:
    """Everything a launch may change, by identity where identity matters."""

    pages: Snapshot
    queues: tuple[tuple[int, ...], ...]
    acks: tuple[tuple[int, ...], ...]
    ack_rows: tuple[list[list[int]], list[list[int]]]
    producer_index: int
    inflight: tuple[int, ...]
    pending: tuple[tuple[int, int, int, frozenset[int], frozenset[int], bool], ...]


def view(rig: Rig) -> ControllerView:
    c = rig.controller
    return ControllerView(
        snapshot(rig),
        tuple(
            tuple(id(op) for op in q)
            for q in (c.write_queue, c.draft_write_queue, c.load_queue, c.draft_load_queue)
        ),
        tuple(tuple(id(a) for a in q) for q in (c.ack_write_queue, c.ack_load_queue)),
        (ack_rows(c.ack_write_queue), ack_rows(c.ack_load_queue)),
        c.layer_done_counter.producer_index,
        tuple(id(t) for t in c.inflight.snapshot()),
        tuple(
            (
                node_id,
                id(s),
                len(s.layer_events),
                frozenset(s.completed_target_layers),
                frozenset(s.completed_draft_layers),
                s.ack_appended,
            )
            for node_id, s in c.pending_layer_writes.items()
        ),
    )


def launch_fails(
    rig: Rig, call: Callable[[], object], stream: str = "write"
) -> TransferLaunchError:
    """``call`` raises one TransferLaunchError and leaves the controller exactly as it was."""
    before = view(rig)
    with pytest.raises(TransferLaunchError, match=r"a copy failed to launch") as caught:
        call()
    assert view(rig) == before
    # Verify no copy of the failed call is still queued: it could land in a freed slot
    c = rig.controller
    assert (c.load_stream if stream == "load" else c.write_stream).query()
    return caught.value


def sim(rig: Rig) -> SimDevice:
    assert isinstance(rig.device, SimDevice)
    return rig.device


def faulty(rig: Rig) -> FaultyDevice:
    assert isinstance(rig.device, FaultyDevice)
    return rig.device


def filled(rig: Rig, uid: int, pages: int = 1) -> torch.Tensor:
    locs = alloc(rig, pages * PAGE)
    for pool, draft in rig.device_pools():
        fill_node(pool, locs, uid, draft=draft)
    return locs


def assert_host_holds(rig: Rig, host: torch.Tensor, uid: int) -> None:
    for host_pool, draft in rig.host_pools():
        assert_rows(host_pool, host, host_pool.device_pool, uid, draft=draft, where=f"host n{uid}")


# -- start_writing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2], ids=["target-copy", "draft-copy-after-target"])
def test_a_write_whose_copy_fails_to_launch_frees_its_slots_and_the_retry_backs_it_up(
    k: int,
) -> None:
    # n1 written (ack undrained) -> write n2 fails at copy k -> as before, n2's slots free
    rig = build_rig(FaultyDevice(), draft_layer_num=2)
    c = rig.controller
    c.write(filled(rig, 1), node_id=1)
    locs = filled(rig, 2)
    faulty(rig).arm(k)
    error = launch_fails(rig, lambda: c.write(locs, node_id=2))
    assert isinstance(error, HiCacheFault) and isinstance(error, RuntimeError)
    assert not isinstance(error, ValueError | AssertionError)  # not misuse, not an invariant
    assert isinstance(error.__cause__, RuntimeError) and FAULT in str(error.__cause__)
    assert error.node_ids == [2] and error.action == "start_writing"
    assert ack_rows(c.ack_write_queue) == [[1]]

    # heal -> retry -> both acks -> the host holds n2's bytes, target and draft
    faulty(rig).disarm()
    host = c.write(locs, node_id=2)
    assert isinstance(host, torch.Tensor)
    sim(rig).run_until_idle()
    assert drain_acks(c.ack_write_queue) == [[1], [2]]
    assert_host_holds(rig, host, 2)


def test_a_merged_start_writing_that_fails_requeues_the_same_ops() -> None:
    # held writes n1, n2 -> start_writing's host copy raises -> both ops queued again, no ack
    rig = build_rig(SimDevice(), controller_class=HeldWriteController)
    c = rig.controller
    assert isinstance(c, HeldWriteController)
    c.hold = True
    hosts = {uid: c.write(filled(rig, uid), node_id=uid) for uid in (1, 2)}
    c.hold = False
    heal = fail_on_call(rig.host_pool, "backup_from_device_all_layer", 1)
    error = launch_fails(rig, c.start_writing)
    assert error.node_ids == [1, 2]
    assert len(c.write_queue) == 2 and c.inflight.snapshot() == []

    heal()
    c.start_writing()
    assert ack_rows(c.ack_write_queue) == [[1, 2]]
    sim(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    for uid, host in hosts.items():
        assert isinstance(host, torch.Tensor)
        assert_host_holds(rig, host, uid)


def test_a_typed_error_inside_a_launch_keeps_its_channel_and_is_rolled_back() -> None:
    # a host pool refusing its indices at launch is misuse, not a fault: same rollback, its type
    rig = build_rig(SimDevice())
    c = rig.controller
    locs = filled(rig, 1)
    fail_on_call(rig.host_pool, "backup_from_device_all_layer", 1, HiCacheInputError("bad rows"))
    before = view(rig)
    with pytest.raises(HiCacheInputError, match=r"bad rows"):
        c.write(locs, node_id=1)
    assert view(rig) == before


# -- start_loading ---------------------------------------------------------------------------------
def backed_up_and_evicted(rig: Rig, uids: tuple[int, ...]) -> dict[int, torch.Tensor]:
    c = rig.controller
    hosts: dict[int, torch.Tensor] = {}
    for uid in uids:
        locs = filled(rig, uid, pages=2)
        host = c.write(locs, node_id=uid)
        assert isinstance(host, torch.Tensor)
        hosts[uid] = host
        sim(rig).run_until_idle()
        drain_acks(c.ack_write_queue)
        c.evict_device(locs)
    for pool, _ in rig.device_pools():
        for layer in range(pool.layer_num):
            for component in pool.component_names():
                pool.component_buffer(component, layer).zero_()
    return hosts


@pytest.mark.parametrize("draft_layer_num", [None, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_load_whose_layer_k_fails_to_launch_gives_its_producer_slot_back(
    k: int, draft_layer_num: int | None
) -> None:
    # n1 loading on slot 0 (ack undrained) -> n2 queued -> start_loading fails at copy k
    rig = build_rig(FaultyDevice(), draft_layer_num=draft_layer_num)
    c = rig.controller
    hosts = backed_up_and_evicted(rig, (1, 2))
    first = c.load(hosts[1], node_id=1)
    assert first is not None and c.start_loading() == 0
    new = c.load(hosts[2], node_id=2)
    assert new is not None
    faulty(rig).arm(k)
    error = launch_fails(rig, c.start_loading, "load")
    assert error.action == "start_loading" and error.node_ids == [2]
    assert c.layer_done_counter.producer_index == 0 and ack_rows(c.ack_load_queue) == [[1]]

    # heal -> retry takes the slot the failed call gave back -> n2's bytes land at new locs
    faulty(rig).disarm()
    assert c.start_loading() == 1
    sim(rig).run_until_idle()
    assert drain_acks(c.ack_load_queue) == [[1], [2]]
    for pool, draft in rig.device_pools():
        assert_rows(pool, new, pool, 2, draft=draft, where="device n2")


def test_a_failed_start_loading_keeps_the_in_flight_tracker_as_it_was() -> None:
    # start_loading prunes finished transfers before re-recording a slot; a failure restores them
    rig = build_rig(SimDevice())
    c = rig.controller
    hosts = backed_up_and_evicted(rig, (1,))
    new = c.load(hosts[1], node_id=1)
    assert new is not None
    c.write(filled(rig, 9), node_id=9)
    sim(rig).run_until_idle()  # the write finished; the tracker prunes it lazily
    assert len(c.inflight) == 1
    heal = fail_on_call(rig.host_pool, "load_to_device_per_layer", 2)
    launch_fails(rig, c.start_loading, "load")
    heal()
    assert c.start_loading() == 0
    sim(rig).run_until_idle()
    assert drain_acks(c.ack_load_queue) == [[1]]
    assert_rows(rig.device_pool, new, rig.device_pool, 1, where="device n1")


# -- CP per-layer write-back -------------------------------------------------------------------------
def cp_rig(device: SimDevice) -> Rig:
    return build_rig(device, kind="nsa", cp_layout=CpSharedKVLayout(1, 0, PAGE), draft_layer_num=4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_cp_write_whose_layer_copy_fails_frees_its_reservation(k: int) -> None:
    # write() on CP = reserve + catch-up of every layer -> copy k fails -> nothing pending,
    # the reserved slots are free, no ack -> heal -> the retry backs the node up
    rig = cp_rig(FaultyDevice())
    c = rig.controller
    locs = filled(rig, 1, pages=2)
    faulty(rig).arm(k)
    error = launch_fails(rig, lambda: c.write(locs, node_id=1))
    assert error.node_ids == [1]
    assert not c.pending_layer_writes and not c.ack_write_queue

    faulty(rig).disarm()
    result = c.write(locs, node_id=1)
    assert isinstance(result, HiCacheWriteResult)
    sim(rig).run_until_idle()
    assert drain_acks(c.ack_write_queue) == [[1]]
    meta = result.metadata
    assert_rows(rig.host_pool, meta.host_indices, rig.device_pool, 1, where="host n1")
    assert meta.draft_host_indices is not None and rig.draft_host_pool is not None
    assert_rows(
        rig.draft_host_pool,
        meta.draft_host_indices,
        rig.draft_host_pool.device_pool,
        1,
        draft=True,
        where="draft host n1",
    )


def test_a_layer_end_hook_whose_copy_fails_keeps_the_pending_progress() -> None:
    # early reservation -> layer 0 backed up -> layer 1's hook fails -> progress still {0}
    rig = cp_rig(FaultyDevice())
    c = rig.controller
    locs = filled(rig, 1, pages=2)
    reservation = c.reserve_write_cp(locs, node_id=1)
    assert isinstance(reservation, HiCacheWriteReservation)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    rig.device_pool.notify_layer_end(0)
    faulty(rig).arm(1)
    error = launch_fails(rig, lambda: rig.device_pool.notify_layer_end(1))
    assert error.action == "CP per-layer write"
    assert c.pending_layer_writes[1].completed_target_layers == {0}

    # heal -> the forward's hooks go on -> one ack after the last target and draft layer
    faulty(rig).disarm()
    for layer in range(1, 4):
        if layer < rig.device_pool.layer_num:
            rig.device_pool.notify_layer_end(layer)
        assert rig.draft_device_pool is not None
        rig.draft_device_pool.notify_layer_end(layer)
    rig.draft_device_pool.notify_layer_end(0)
    assert ack_rows(c.ack_write_queue) == [[1]]
    sim(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    assert_rows(rig.host_pool, reservation.host_indices, rig.device_pool, 1, where="host n1")


def test_submit_write_cp_layer_that_fails_forgets_the_state_it_registered() -> None:
    rig = cp_rig(FaultyDevice())
    c = rig.controller
    reservation = c.reserve_write_cp(filled(rig, 1, pages=2), node_id=1)
    assert isinstance(reservation, HiCacheWriteReservation)
    faulty(rig).arm(1)
    launch_fails(rig, lambda: c.submit_write_cp_layer(reservation, 0))
    assert not c.pending_layer_writes
    faulty(rig).disarm()
    c.submit_write_cp_per_layer(reservation)
    assert ack_rows(c.ack_write_queue) == [[1]]


def test_submit_write_cp_all_layer_that_fails_leaves_the_reservation_to_its_caller() -> None:
    rig = cp_rig(FaultyDevice())
    c = rig.controller
    locs = filled(rig, 1, pages=2)
    reservation = c.reserve_write_cp(locs, node_id=1)
    assert isinstance(reservation, HiCacheWriteReservation)
    faulty(rig).arm(2)  # the draft copy, after the target's
    launch_fails(rig, lambda: c.submit_write_cp_all_layer(reservation))
    assert not c.write_queue and not c.draft_write_queue

    faulty(rig).disarm()
    c.submit_write_cp_all_layer(reservation)
    sim(rig).run_until_idle()
    assert drain_acks(c.ack_write_queue) == [[1]]
    assert_rows(rig.host_pool, reservation.host_indices, rig.device_pool, 1, where="host n1")


# -- on a GPU --------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_a_load_whose_copy_fails_on_the_gpu_rolls_back_and_the_retry_lands() -> None:
    # real streams: write n1 -> evict -> load -> layer 1's H2D fails to launch -> rolled back,
    # the load stream is idle (layer 0's copy landed) -> heal -> retry -> bytes at the new locs
    device = CudaDevice()
    rig = build_rig(device, draft_layer_num=5)
    c = rig.controller
    locs = filled(rig, 1, pages=2)
    host = c.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    device.synchronize()
    drain_acks(c.ack_write_queue)
    c.evict_device(locs)
    new = c.load(host, node_id=1)
    assert new is not None
    heal = fail_on_call(rig.host_pool, "load_to_device_per_layer", 2)
    launch_fails(rig, c.start_loading, "load")
    heal()
    assert c.start_loading() == 0
    device.synchronize()
    assert drain_acks(c.ack_load_queue) == [[1]]
    for pool, draft in rig.device_pools():
        assert_rows(pool, new, pool, 1, draft=draft, where="device n1")
