"""Three rule families where bugs live, each shown catching a planted bug the older rules miss.

- ``forward_read_batch``: one forward batch over nodes loaded by different ``start_loading``
  calls; the consumer is a list of producer slots (capability ``multi_consumer``) and the one
  wait must cover every slot's layer event (INV-11).
- ``scribble_free_host``: the CPU writes into every host slot the harness's pools report free
  while copies are queued; a copy that still writes a freed slot shows up (INV-07).
- ``reset_in_flight``: a reset with copies queued (capability ``reset_drains``); every free
  page and slot is then poisoned, so a copy that lands after the reset shows up (INV-18).

Each story replays a short trace on a planted bug (a mutant defined here, or one of the
catalogue's in ``fuzz/mutants/``) and on the reference: the first fails with the rule's invariant,
the second passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.adapters.sglang import SEED_CAPABILITIES, UPSTREAM_CAPABILITIES
from hicache_ref.harness.step_types import StepArg
from hicache_ref.harness.steps.replay import ReplayResult, replay
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

REPO = Path(__file__).resolve().parents[2]


def _step(rule: str, **args: StepArg) -> Step:
    return Step(rule=rule, args=args)  # type: ignore[arg-type]


def _replay(implementation: str, config: HarnessConfig, steps: Sequence[Step]) -> ReplayResult:
    header = TraceHeader(implementation=implementation, config=config)
    return replay(Trace(header=header, steps=tuple(steps)))


# -- planted bugs ---------------------------------------------------------------------------------
class FirstSlotCounter(LayerDoneCounter):
    """A batch's consumer list collapses to its first slot (what an int-only ``set_consumer``
    does with a batch): the forward waits for one load and reads the others' layers early."""

    def set_consumer(self, index: Any) -> None:
        if isinstance(index, (list, tuple, set)):
            index = sorted(index)[:1]  # MUTATION: only the first producer slot is waited on
        super().set_consumer(index)


class FirstSlotController(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_done_counter.__class__ = FirstSlotCounter


class ResetWithoutDrainController(HiCacheController):
    """``reset()`` clears its queues without waiting for the streams (0.5.10's and the seed's
    reset), while the adapter still declares ``reset_drains``."""

    def reset(self) -> None:
        streams = (self.write_stream, self.load_stream)
        synchronize = [stream.synchronize for stream in streams]
        for stream in streams:
            stream.synchronize = lambda: None  # type: ignore[method-assign]  # MUTATION
        try:
            super().reset()
        finally:
            for stream, sync in zip(streams, synchronize, strict=True):
                stream.synchronize = sync  # type: ignore[method-assign]


PLANTED: dict[str, Callable[[], object]] = {
    "test:first-slot": lambda: MutantImplementation(FirstSlotController, "first-slot"),
    "test:reset-without-drain": lambda: MutantImplementation(
        ResetWithoutDrainController, "reset-without-drain"
    ),
    # caught in the catalogue
    "test:cancel-without-write-sync": lambda: get_implementation(
        "mutant:cancel_without_write_sync"
    ),
}
"""The planted bugs, by the names their traces give (named for each test of this module)."""


@pytest.fixture(autouse=True)
def _planted(name_implementation: Callable[[str, Callable[[], object]], None]) -> None:
    for name, factory in PLANTED.items():
        name_implementation(name, factory)


# -- capabilities ---------------------------------------------------------------------------------
def test_multi_consumer_and_reset_drains_are_declared_where_the_code_has_them() -> None:
    # reference: LayerDoneCounter takes a list; reset() synchronizes both streams first
    assert {"multi_consumer", "reset_drains"} <= ReferenceImplementation.capabilities
    assert {"multi_consumer", "reset_drains"} <= CAPABILITIES
    # the seed: a list-taking counter, a reset that only clears; 0.5.10 / 0.5.23: neither
    assert "multi_consumer" in SEED_CAPABILITIES and "reset_drains" not in SEED_CAPABILITIES
    assert not {"multi_consumer", "reset_drains"} & UPSTREAM_CAPABILITIES


# -- forward batches over several producer slots ------------------------------------------------
BATCH_CONFIG = HarnessConfig(page_size=2, layer_num=2, device_pages=16, host_pages=8)


def _batch_over_two_slots(load_ops: int, *, batched: bool) -> list[Step]:
    # two nodes backed up and evicted -> each loaded by its own start_loading (slots 0 and 1)
    steps = [
        _step("prefill", tokens=4),
        _step("prefill", tokens=4),
        _step("forward_layer"),
        _step("forward_layer"),
        _step("write", node=0),
        _step("write", node=1),
        _step("synchronize", stream="write"),
        _step("drain_acks"),
        _step("evict_device", node=0),
        _step("evict_device", node=1),
        _step("synchronize", stream="forward"),
        _step("load", node=0),
        _step("start_loading"),
        _step("load", node=1),
        _step("start_loading"),
    ]
    # one forward batch reads layer 1 of both -> the start_loading fences run -> part of the H2D
    if batched:
        steps.append(_step("forward_read_batch", nodes="0,1", layer=1, draft=False))
    else:
        steps += [_step("forward_read", node=n, layer=1, draft=False) for n in (0, 1)]
    steps += [
        _step("advance", stream="forward", n=2),
        _step("advance", stream="load", n=load_ops),
        _step("advance", stream="forward", n=16),
    ]
    return steps


@pytest.mark.parametrize("load_ops", range(1, 10))
def test_batch_read_waits_for_every_producer_slot(load_ops: int) -> None:
    # reference: the batch's one wait covers slots 0 and 1, whatever part of the H2D ran
    steps = _batch_over_two_slots(load_ops, batched=True)
    assert not _replay("reference", BATCH_CONFIG, steps).failed


def test_a_batch_that_waits_on_its_first_slot_only_is_caught() -> None:
    # first-slot counter: node 0's layer landed, node 1's did not -> the read sees its zeros
    fired = {
        _replay("test:first-slot", BATCH_CONFIG, _batch_over_two_slots(n, batched=True)).signature()
        for n in range(1, 10)
    }
    assert "INV-11" in fired
    # the same program read node by node never puts two slots in one consumer: it passes
    for n in range(1, 10):
        single = _batch_over_two_slots(n, batched=False)
        assert not _replay("test:first-slot", BATCH_CONFIG, single).failed


def test_batch_read_is_skipped_without_multi_consumer(
    name_implementation: Callable[[str, Callable[[], object]], None],
) -> None:
    # an implementation whose set_consumer takes one int -> the batch step is skipped, says why
    class OneSlot(ReferenceImplementation):
        name = "test:one-slot"
        capabilities = ReferenceImplementation.capabilities - {"multi_consumer"}

    name_implementation(OneSlot.name, OneSlot)
    result = _replay(OneSlot.name, BATCH_CONFIG, _batch_over_two_slots(5, batched=True))
    assert not result.failed
    assert "no multi_consumer" in result.skipped[15]


# -- CPU writes into free host slots while copies are queued ------------------------------------
def _cancel_then_scribble() -> list[Step]:
    # an early-reserved node's layer 0 is submitted -> cancel -> another batch computes
    # (copies queued) -> the CPU scribbles every free host slot -> the write stream runs
    return [
        _step("prefill", tokens=4, early_reserve=True),
        _step("forward_layer"),
        _step("cancel", node=0),
        _step("prefill", tokens=2),
        _step("forward_layer"),
        _step("scribble_free_host"),
        _step("synchronize", stream="write"),
    ]


@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_cancel_that_does_not_drain_the_write_stream_is_caught(
    cp_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fuzz/mutants/cancel_without_write_sync: the stale D2H lands in freed slots
    config = HarnessConfig(
        page_size=2, layer_num=2, cp_size=cp_size, pool_kind="nsa", device_pages=16, host_pages=8
    )
    # the lockstep oracle sees the early free at the cancel itself (INV-07, step 2) ...
    on_mutant = _replay("test:cancel-without-write-sync", config, _cancel_then_scribble())
    assert on_mutant.signature() == "INV-07", on_mutant.error
    assert "lockstep at step 2 (cancel" in str(on_mutant.error)
    # ... and without it, the CPU scribble is what catches the stale copy landing
    monkeypatch.setenv("HICACHE_LOCKSTEP", "0")
    on_mutant = _replay("test:cancel-without-write-sync", config, _cancel_then_scribble())
    assert on_mutant.signature() == "INV-07", on_mutant.error
    assert "scribble into a free host slot" in str(on_mutant.error)
    on_reference = _replay("reference", config, _cancel_then_scribble())
    assert not on_reference.failed, on_reference.error
    assert on_reference.outcomes[5].startswith("scribbled")


# -- resets with copies in flight ---------------------------------------------------------------
RESET_CONFIG = HarnessConfig(page_size=2, layer_num=2, device_pages=16, host_pages=8)
D2H_AT_RESET = [
    # a backup's D2H queued -> reset -> the stream runs
    _step("prefill", tokens=4),
    _step("forward_layer"),
    _step("forward_layer"),
    _step("write", node=0),
    _step("reset_in_flight"),
    _step("advance", stream="write", n=16),
]
H2D_AT_RESET = [
    # a load's H2D queued -> reset -> the stream runs
    _step("prefill", tokens=4),
    _step("forward_layer"),
    _step("forward_layer"),
    _step("write", node=0),
    _step("synchronize", stream="write"),
    _step("drain_acks"),
    _step("evict_device", node=0),
    _step("load", node=0),
    _step("start_loading"),
    _step("reset_in_flight"),
    _step("synchronize", stream="load"),
]


@pytest.mark.parametrize("steps", [D2H_AT_RESET, H2D_AT_RESET], ids=["d2h", "h2d"])
def test_a_reset_that_does_not_drain_its_streams_is_caught(steps: list[Step]) -> None:
    # reference: reset() synchronizes first -> nothing lands in the poisoned pages afterwards
    on_reference = _replay("reference", RESET_CONFIG, steps)
    assert not on_reference.failed, on_reference.error
    assert "copies queued" in on_reference.outcomes[steps.index(_step("reset_in_flight"))]
    # reset-without-drain: the stale copy lands after the reset, moving one poison into the other
    on_mutant = _replay("test:reset-without-drain", RESET_CONFIG, steps)
    assert on_mutant.signature() == "INV-18", on_mutant.error
    assert "scribble into a free" in str(on_mutant.error)
