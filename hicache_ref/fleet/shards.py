"""Shards and seed lanes: which seeds each worker of each runner takes.

A fleet is ``N`` runners (``--shard I/N``, I counted from 1, as a CI matrix numbers its jobs)
of ``W`` worker processes each (``--workers W``). Worker ``w`` of shard ``I`` runs round ``k``
with the seed

    base + (k * W + w) * N + (I - 1)

so shard ``I`` owns the seeds ``base + (I - 1)`` modulo ``N`` whatever its worker count (two
runners of different sizes still never overlap), its workers interleave inside that class, and
together the fleet's first rounds are exactly the seeds ``base, base + 1, ...`` with no gap.
A worker's lane is its first seed and a stride (``CampaignReport.seed``, ``seed_stride``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    """Runner ``index`` of ``count`` (1-based, as ``--shard 2/4`` writes it)."""

    index: int = 1
    count: int = 1

    def __post_init__(self) -> None:
        # Verify the runner is one of the fleet's
        assert 1 <= self.index <= self.count, f"shard {self.index}/{self.count} is not in 1..N"

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``I/N`` with ``1 <= I <= N``, for argparse (a bad one names the legal form)."""
    found = _SHARD.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not I/N; write this runner's number and the runner count, such as 2/4"
        )
    index, count = int(found.group(1)), int(found.group(2))
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the runner number must be 1 to {count} (shards count from 1: 1/{count} "
            f"... {count}/{count})"
        )
    return Shard(index, count)


@dataclass(frozen=True)
class SeedLane:
    """The seeds worker ``worker`` of ``workers`` on ``shard`` runs, one per round."""

    base: int
    shard: Shard
    worker: int
    workers: int

    def __post_init__(self) -> None:
        # Verify the worker is one of its runner's
        assert 0 <= self.worker < self.workers, f"worker {self.worker} of {self.workers}"

    @property
    def first(self) -> int:
        return self.base + self.worker * self.shard.count + (self.shard.index - 1)

    @property
    def stride(self) -> int:
        return self.workers * self.shard.count

    def seed(self, round_index: int) -> int:
        """The seed of round ``round_index`` (as ``run_campaign`` computes it from the lane)."""
        assert round_index >= 0, f"round {round_index} is negative"
        return self.first + round_index * self.stride


def get_lanes(base: int, shard: Shard, workers: int) -> list[SeedLane]:
    """Every worker's lane on one runner."""
    assert workers >= 1, f"a runner needs a worker, got {workers}"
    return [SeedLane(base, shard, worker, workers) for worker in range(workers)]
