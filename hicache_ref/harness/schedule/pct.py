"""A PCT-style bias over which storage thread runs next (the ``campaign`` profile).

Probabilistic concurrency testing (Burckhardt et al., ASPLOS '10; AWS shuttle's PCT scheduler)
gives each thread a random priority at the start of a case, always runs the highest-priority
thread that can move, and at ``depth - 1`` random steps drops the running thread's priority below
every other: a bug that needs ``d`` ordering constraints is found with probability about
``1 / (n k^(d-1))``, where uniform draws rarely line up more than one. The storage rules ask
``pick`` only in the ``campaign`` profile (``HICACHE_PROFILE``); the trace records the kind it
picked, so a replay needs no bias; a failing case's ``describe()`` goes into the campaign
report (``failures[i]["pct"]``: which depth, and which priority changes, found what). The
default (``ci``, ``dev``) draw stays uniform over the threads that can move.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

PCT_DEPTH = 3
"""Priority changes per case, plus one: most real ordering bugs have depth 1 to 3."""
PCT_STEPS = 200
"""The storage steps over which the change points are drawn."""


class PctBias:
    """One case's thread priorities and change points, from the case's seed."""

    def __init__(self, seed: int, kinds: Sequence[str], depth: int = PCT_DEPTH) -> None:
        rng = random.Random(f"pct-{seed}")
        self.priority = {kind: rng.random() for kind in kinds}
        self.changes = set(rng.sample(range(1, PCT_STEPS), max(0, depth - 1)))
        self.depth = depth
        self.step = 0
        self.changed = 0  # how many change points this case has passed (what found a bug)
        self.changed_at: list[int] = []  # the picks at which a priority changed

    def describe(self) -> dict[str, int | list[int]]:
        """What the campaign report says of a failing case's schedule: the PCT depth drawn, the
        priority changes the case passed before it failed, at which picks, of how many."""
        return {
            "depth": self.depth,
            "changes": self.changed,
            "changed_at": list(self.changed_at),
            "picks": self.step,
        }

    def pick(self, runnable: Sequence[str]) -> str:
        """The highest-priority runnable kind; at a change point it drops below every other."""
        self.step += 1
        chosen = max(runnable, key=lambda kind: self.priority[kind])
        if self.step in self.changes:
            self.priority[chosen] = min(self.priority.values()) - 1.0
            self.changed += 1
            self.changed_at.append(self.step)
        return chosen


def campaign_bias(seed: int, kinds: Sequence[str]) -> PctBias | None:
    """The bias of a case under the ``campaign`` profile, else None (uniform draws)."""
    if os.environ.get("HICACHE_PROFILE", "ci") != "campaign":
        return None
    return PctBias(seed, kinds)
