"""Each stream-ordering rule of the controller, shown as a pair on SimDevice.

For every rule the real controller gives the right bytes under an adversarial schedule (the
stream the rule holds back runs as far as it can before the others), and a subclass that drops
exactly that one wait gives wrong bytes under the same schedule. So the simulator really models
ordering, and each wait in the controller is load-bearing.

Rules: (a) start_writing's fence after queued KV stores (INV-12); (b) start_loading's fence after
forward work already queued on pages reused by the load (sglang#36738, INV-08); (c) the per-layer
CP D2H waits on the layer event recorded after that layer's store (INV-12); (d) the forward's
``get_key_buffer(i)`` waits for layer i of the consumer slot (INV-11); (e) the load finish event
covers the draft tail when the draft has more layers than the target (INV-04).
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import CacheOperation, HiCacheAck, LayerLoadingEvent
from hicache_ref.device import SimDevice, SimStream
from hicache_ref.invariants.models import HiCacheLayerWriteState, HiCacheWriteReservation
from hicache_ref.pools import CpSharedKVLayout, KVCache

from .rig import Rig, build_rig, drain_acks, fill_node, node_rows, run_first, zero_device_pool

PAGE = 4


def _sim(rig: Rig) -> SimDevice:
    assert isinstance(rig.device, SimDevice)
    return rig.device


def _stream(stream: object) -> SimStream:
    assert isinstance(stream, SimStream)
    return stream


def _alloc(rig: Rig, tokens: int) -> torch.Tensor:
    locs = rig.allocator.alloc(tokens)
    assert locs is not None
    return locs


def _launch_store(
    rig: Rig, pool: KVCache, locs: torch.Tensor, uid: int, layer: int | None = None
) -> None:
    """The forward queues a KV store of node ``uid`` on the default stream (not run yet)."""
    layers = None if layer is None else range(layer, layer + 1)
    rig.device.launch(
        lambda: fill_node(pool, locs, uid, layers=layers), label=f"store n{uid}", kind="kernel"
    )


def _holds(pool: Any, indices: torch.Tensor, shapes: KVCache, uid: int, layer: int) -> bool:
    """Whether every component of ``layer`` at ``indices`` holds node ``uid``'s rows."""
    positions = torch.arange(len(indices))
    return all(
        torch.equal(
            pool.read_rows(component, layer, indices),
            node_rows(shapes, uid, False, layer, component, positions),
        )
        for component in shapes.component_names()
    )


def _holds_every_layer(pool: Any, indices: torch.Tensor, shapes: KVCache, uid: int) -> bool:
    return all(_holds(pool, indices, shapes, uid, layer) for layer in range(shapes.layer_num))


# -- (a) start_writing's fence -----------------------------------------------------------------------
class WriteWithoutStoreFence(HiCacheController):
    """``start_writing`` minus ``start_event.wait(write_stream)`` (target-only, as used here)."""

    def start_writing(self) -> None:
        op = CacheOperation.merge_ops(self.write_queue)
        self.write_queue.clear()
        host_indices, device_indices = self.move_indices(op, self.mem_pool_host)
        start_event, finish_event = self.device_module.Event(), self.device_module.Event()
        start_event.record()
        with self.device_module.stream(self.write_stream):
            # MUTATION: no start_event.wait(self.write_stream)
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_indices, device_indices, self.io_backend
            )
            finish_event.record()
        self._append_write_ack(HiCacheAck(start_event, finish_event, list(op.node_ids)))


def _write_right_after_a_queued_store(controller_class: type[HiCacheController]) -> bool:
    """n1's old bytes on the device -> the forward queues a store of new KV -> write(n1).

    Returns whether the host copy holds the stored (new) bytes once everything ran.
    """
    rig = build_rig(SimDevice(), controller_class=controller_class)
    locs = _alloc(rig, 2 * PAGE)
    fill_node(rig.device_pool, locs, uid=1)
    _launch_store(rig, rig.device_pool, locs, uid=2)
    host = rig.controller.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    # adversarial: the write stream runs as far as it can before the forward stream
    run_first(_sim(rig), _stream(rig.controller.write_stream))
    assert drain_acks(rig.controller.ack_write_queue) == [[1]]
    return _holds_every_layer(rig.host_pool, host, rig.device_pool, uid=2)


def test_start_writing_fence_backs_up_the_stores_queued_before_the_write() -> None:
    # store queued -> write -> write stream first -> host holds the stored bytes (INV-12)
    assert _write_right_after_a_queued_store(HiCacheController)


def test_write_without_the_start_fence_backs_up_stale_rows() -> None:
    # same schedule without the fence -> the D2H overtakes the store
    assert not _write_right_after_a_queued_store(WriteWithoutStoreFence)


# -- (b) start_loading's fence -----------------------------------------------------------------------
class LoadWithoutForwardFence(HiCacheController):
    """``start_loading`` minus ``start_event.wait(load_stream)`` (target-only, as used here)."""

    def start_loading(self) -> int:
        producer_id = self.layer_done_counter.update_producer()
        op = CacheOperation.merge_ops(self.load_queue)
        self.load_queue.clear()
        host_indices, device_indices = self.move_indices(op, self.mem_pool_host)
        producer_event = self.layer_done_counter.events[producer_id]
        producer_event.start_event.record()
        with self.device_module.stream(self.load_stream):
            # MUTATION: no producer_event.start_event.wait(self.load_stream)
            self._issue_load_layers(producer_event, host_indices, device_indices, None, None)
        self._append_load_ack(
            HiCacheAck(producer_event.start_event, producer_event.finish_event, list(op.node_ids))
        )
        return producer_id


def _load_into_pages_a_queued_store_still_writes(
    controller_class: type[HiCacheController],
) -> bool:
    """n1 backed up and evicted -> a launched round stores into pages that are then freed ->
    load(n1) reuses them (LIFO) -> returns whether the device ends with n1's bytes."""
    rig = build_rig(SimDevice(), alloc_policy="lifo", controller_class=controller_class)
    c = rig.controller
    locs = _alloc(rig, 2 * PAGE)
    fill_node(rig.device_pool, locs, uid=1)
    host = c.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    _sim(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    c.evict_device(locs)
    # overlap scheduling: the launched round still stores into pages the scheduler frees now
    victim = _alloc(rig, 2 * PAGE)
    _launch_store(rig, rig.device_pool, victim, uid=9)
    c.evict_device(victim)
    loaded = c.load(host, node_id=1)
    assert loaded is not None and torch.equal(loaded, victim)
    c.start_loading()
    # adversarial: the load stream runs as far as it can before the forward stream
    run_first(_sim(rig), _stream(c.load_stream))
    assert drain_acks(c.ack_load_queue) == [[1]]
    return _holds_every_layer(rig.device_pool, loaded, rig.device_pool, uid=1)


def test_start_loading_fence_lands_the_load_after_queued_forward_stores() -> None:
    # store into freed pages queued -> load reuses them -> H2D after the store -> n1's bytes
    assert _load_into_pages_a_queued_store_still_writes(HiCacheController)


def test_load_without_the_start_fence_is_overwritten_by_the_older_store() -> None:
    # same schedule without the fence -> the stale store lands after the H2D
    assert not _load_into_pages_a_queued_store_still_writes(LoadWithoutForwardFence)


# -- (c) per-layer CP write waits on the layer's store ------------------------------------------------
class LayerWriteWithoutStoreEvent(HiCacheController):
    """``_submit_write_cp_layer_states`` minus ``layer_event.wait(write_stream)``.

    Pared to what this file drives: one rank, target layers only, every state owns pages.
    """

    def _submit_write_cp_layer_states(
        self,
        states: list[HiCacheLayerWriteState],
        layer_id: int,
        *,
        submit_target: bool = True,
        submit_draft: bool = True,
    ) -> None:
        layer_event = self.device_module.Event()
        layer_event.record()
        finished = []
        with self.device_module.stream(self.write_stream):
            for state in states:
                assert state.host_indices is not None
                assert state.physical_device_indices is not None
                state.start_event.wait(self.write_stream)
                # MUTATION: no layer_event.wait(self.write_stream)
                self.mem_pool_host.backup_from_device_per_layer(
                    self.mem_pool_device,
                    state.host_indices,
                    state.physical_device_indices,
                    layer_id,
                    self.io_backend,
                )
                state.completed_target_layers.add(layer_id)
                if self._layer_write_state_done(state):
                    state.finish_event.record()
                    finished.append(state)
        for state in finished:
            self._append_layer_write_ack(state)


def _per_layer_backup_of_layers_stored_during_the_forward(
    controller_class: type[HiCacheController],
) -> bool:
    """Reserve early -> per layer: queue the store, fire the layer-end hook -> whether the
    host copy holds the stored bytes of every layer."""
    rig = build_rig(
        SimDevice(),
        kind="nsa",
        cp_layout=CpSharedKVLayout(1, 0, PAGE),
        controller_class=controller_class,
    )
    c = rig.controller
    locs = _alloc(rig, 2 * PAGE)
    fill_node(rig.device_pool, locs, uid=1)
    reservation = c.reserve_write_cp(locs, node_id=1)
    assert isinstance(reservation, HiCacheWriteReservation)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    for layer in range(rig.device_pool.layer_num):
        _launch_store(rig, rig.device_pool, locs, uid=2, layer=layer)
        rig.device_pool.notify_layer_end(layer)
    # adversarial: the write stream runs as far as it can before the forward stream
    run_first(_sim(rig), _stream(c.write_stream))
    assert drain_acks(c.ack_write_queue) == [[1]]
    return _holds_every_layer(rig.host_pool, reservation.host_indices, rig.device_pool, uid=2)


def test_per_layer_backup_waits_for_each_layers_store() -> None:
    # store L_i -> hook -> D2H L_i after the layer event -> host holds every stored layer
    assert _per_layer_backup_of_layers_stored_during_the_forward(HiCacheController)


def test_per_layer_backup_without_the_layer_event_copies_pre_store_rows() -> None:
    # same schedule without the layer wait -> the D2H of a layer overtakes its store
    assert not _per_layer_backup_of_layers_stored_during_the_forward(LayerWriteWithoutStoreEvent)


# -- (d) the consumer wait ---------------------------------------------------------------------------
class _NeverWaits:
    def wait_until(self, threshold: int) -> None:
        return None


class ControllerWithoutConsumerWait(HiCacheController):
    """The device pool's ``get_key_buffer`` no longer waits on the consumer slot's layer event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # MUTATION: the layer transfer counter the forward waits on never waits
        self.mem_pool_device.register_layer_transfer_counter(_NeverWaits())


def _forward_reads_a_loading_batch(controller_class: type[HiCacheController]) -> bool:
    """n1 on host -> load + start_loading -> the forward reads every layer through
    ``get_key_buffer`` of the consumer slot -> whether every read saw n1's bytes."""
    rig = build_rig(SimDevice(), controller_class=controller_class)
    c, pool = rig.controller, rig.device_pool
    locs = _alloc(rig, 2 * PAGE)
    fill_node(pool, locs, uid=1)
    host = c.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    _sim(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    c.evict_device(locs)
    zero_device_pool(pool)
    loaded = c.load(host, node_id=1)
    assert loaded is not None
    producer_id = c.start_loading()
    seen: dict[int, torch.Tensor] = {}
    c.layer_done_counter.set_consumer(producer_id)
    for layer in range(pool.layer_num):
        key_buffer = pool.get_key_buffer(layer)  # waits until the layer landed (INV-11)

        def read(layer: int = layer, key_buffer: torch.Tensor = key_buffer) -> None:
            seen[layer] = key_buffer[loaded].clone()

        rig.device.launch(read, label=f"read L{layer}", kind="kernel")
    c.layer_done_counter.set_consumer(-1)
    # adversarial: the forward stream runs as far as it can before the load stream
    run_first(_sim(rig), _sim(rig).default_stream)
    positions = torch.arange(len(loaded))
    return all(
        torch.equal(seen[layer], node_rows(pool, 1, False, layer, "k", positions))
        for layer in range(pool.layer_num)
    )


def test_forward_read_waits_for_its_layer_of_the_consumer_slot() -> None:
    # set_consumer(producer) -> get_key_buffer(i) waits -> every read sees n1 (INV-11)
    assert _forward_reads_a_loading_batch(HiCacheController)


def test_forward_read_without_the_consumer_wait_sees_stale_rows() -> None:
    # same schedule without the wait -> the reads run before the H2D
    assert not _forward_reads_a_loading_batch(ControllerWithoutConsumerWait)


# -- (e) the load finish event covers the draft tail -------------------------------------------------
class LoadFinishOnLastTargetLayer(HiCacheController):
    """``_issue_load_layers`` recording finish right after the last TARGET layer (the seed's
    ``load_events[-1]``), so a longer draft tail lands after the ack completes."""

    def _issue_load_layers(
        self,
        producer_event: LayerLoadingEvent,
        host_indices: torch.Tensor | None,
        device_indices: torch.Tensor | None,
        draft_host: torch.Tensor | None,
        draft_device: torch.Tensor | None,
    ) -> None:
        draft_pool, draft_host_pool = self._require_draft_pools()
        assert host_indices is not None and device_indices is not None
        assert draft_host is not None and draft_device is not None
        for i in range(max(self.layer_num, self.draft_layer_num)):
            if i < self.draft_layer_num:
                draft_host_pool.load_to_device_per_layer(
                    draft_pool, draft_host, draft_device, i, self.io_backend
                )
                producer_event.complete_draft(i)
            if i < self.layer_num:
                self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, host_indices, device_indices, i, self.io_backend
                )
                producer_event.complete(i)
            if i == self.layer_num - 1:
                # MUTATION: the finish is the last target layer, not the last of both
                producer_event.finish_event.record()


def _draft_rows_when_the_load_ack_completes(controller_class: type[HiCacheController]) -> bool:
    """target 2 layers, draft 4 -> n1 backed up, evicted, loaded -> advance the load stream
    until the ack completes -> whether every draft layer has landed at that moment."""
    rig = build_rig(SimDevice(), layer_num=2, draft_layer_num=4, controller_class=controller_class)
    c = rig.controller
    draft_pool = rig.draft_device_pool
    assert draft_pool is not None
    locs = _alloc(rig, 2 * PAGE)
    fill_node(rig.device_pool, locs, uid=1)
    fill_node(draft_pool, locs, uid=1)
    host = c.write(locs, node_id=1)
    assert isinstance(host, torch.Tensor)
    _sim(rig).run_until_idle()
    drain_acks(c.ack_write_queue)
    c.evict_device(locs)
    zero_device_pool(rig.device_pool)
    zero_device_pool(draft_pool)
    loaded = c.load(host, node_id=1)
    assert loaded is not None
    c.start_loading()
    (ack,) = c.ack_load_queue
    _sim(rig).advance(_sim(rig).default_stream, 10**6)  # the fence before the H2D
    # the tree drains the ack the moment its finish event completes
    while not ack.finish_event.query():
        assert _sim(rig).advance(_stream(c.load_stream), 1) == 1
    return _holds_every_layer(draft_pool, loaded, draft_pool, uid=1)


def test_load_ack_completes_only_after_the_longer_draft_tail_landed() -> None:
    # draft 4 layers > target 2 -> finish recorded after draft layer 3 (INV-04)
    assert _draft_rows_when_the_load_ack_completes(HiCacheController)


def test_load_finish_on_the_last_target_layer_acks_before_the_draft_tail() -> None:
    # finish after target layer 1 -> ack completes while draft layers 2, 3 are still zeros
    assert not _draft_rows_when_the_load_ack_completes(LoadFinishOnLastTargetLayer)
