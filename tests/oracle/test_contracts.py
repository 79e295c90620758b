"""The CrossHair entry points hold on a concrete grid too (the same functions, plain ints)."""

from __future__ import annotations

import itertools
import random

import pytest

from hicache_ref.oracle.contracts import (
    cancel_leaves_no_trace,
    evict_host_frees_everything,
    landed_copies_match_advance,
    per_layer_write_acks_once,
    roundtrip_restores_tags,
    trace_keeps_invariants,
    write_then_drain_backs_up,
)

SHAPES = list(itertools.product((1, 2, 3), (1, 3, 5), (1, 2), (0, 1, 2), (0, 1, 2, 3)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "ps{}-t{}-l{}-d{}-cp{}".format(*s))
def test_write_round_trip_and_landing_hold(shape: tuple[int, int, int, int, int]) -> None:
    assert write_then_drain_backs_up(*shape)
    assert roundtrip_restores_tags(*shape)
    assert landed_copies_match_advance(*shape)


def test_per_layer_writes_ack_once_for_every_shape() -> None:
    for layers, draft, cp in itertools.product((1, 2, 3), (0, 1, 2, 3), (1, 2, 3)):
        assert per_layer_write_acks_once(layers, draft, cp), (layers, draft, cp)


def test_cancel_and_evict_leave_nothing_behind() -> None:
    for layers, cp in itertools.product((2, 3), (1, 2, 3)):
        for submitted in range(layers):
            assert cancel_leaves_no_trace(layers, submitted, cp)
    for cp, draft in itertools.product(range(4), range(3)):
        assert evict_host_frees_everything(cp, draft)


def test_random_traces_of_the_correct_protocol_stay_clean() -> None:
    rng = random.Random(20260601)
    for _ in range(150):
        choices = tuple(rng.randrange(64) for _ in range(24))
        assert trace_keeps_invariants(choices), choices
