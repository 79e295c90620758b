"""Shards and lanes: runners and their workers split the seed space without overlap or gaps."""

from __future__ import annotations

import argparse

import pytest

from hicache_ref.fleet.shards import SeedLane, Shard, get_lanes, parse_shard

ROUNDS = 25


def _seeds(lanes: list[SeedLane], rounds: int = ROUNDS) -> list[int]:
    return [lane.seed(k) for lane in lanes for k in range(rounds)]


@pytest.mark.parametrize(("shards", "workers"), [(1, 1), (1, 2), (4, 1), (3, 2), (4, 14)])
def test_a_fleet_covers_its_first_seeds_once_each(shards: int, workers: int) -> None:
    # every worker of every runner, ROUNDS rounds each -> exactly the seeds 7 .. 7 + all - 1
    lanes = [lane for i in range(1, shards + 1) for lane in get_lanes(7, Shard(i, shards), workers)]
    seeds = _seeds(lanes)
    assert len(seeds) == len(set(seeds))  # disjoint
    assert sorted(seeds) == list(range(7, 7 + shards * workers * ROUNDS))  # no gap


def test_runners_of_different_sizes_never_overlap() -> None:
    # shard 1 of 2 on a 16-core runner, shard 2 of 2 on a 2-core one -> still disjoint
    big, small = get_lanes(0, Shard(1, 2), 14), get_lanes(0, Shard(2, 2), 2)
    assert not set(_seeds(big, 40)) & set(_seeds(small, 300))
    assert {seed % 2 for seed in _seeds(big)} == {0} and {s % 2 for s in _seeds(small)} == {1}


def test_one_worker_on_one_runner_runs_seed_plus_round() -> None:
    (lane,) = get_lanes(5, Shard(), 1)
    assert [lane.seed(k) for k in range(4)] == [5, 6, 7, 8]
    assert (lane.first, lane.stride) == (5, 1)


def test_a_lane_is_deterministic() -> None:
    assert _seeds(get_lanes(3, Shard(2, 3), 4)) == _seeds(get_lanes(3, Shard(2, 3), 4))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("0/4", "shards count from 1"), ("5/4", "must be 1 to 4"), ("1-4", "is not I/N")],
)
def test_a_bad_shard_names_the_form(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=fragment):
        parse_shard(text)


def test_a_shard_reads_as_a_ci_matrix_writes_it() -> None:
    assert parse_shard(" 2 / 4 ") == Shard(2, 4) and Shard(2, 4).label == "2/4"
