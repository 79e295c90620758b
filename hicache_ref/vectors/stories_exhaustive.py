"""Scenes the exhaustive storage checker chose: the shortest interleaving that breaks each window.

For each planted protocol bug of the storage oracle (``oracle.storage.PLANTED_STORAGE_BUGS``),
in a small world of two ranks, ``formal.bounded_storage`` explores every interleaving of the
world breadth-first, moving as the harness grants (``lockstep=True``: a thread kind on every
rank at once, one call's outcome drawn), and returns the shortest op trace that breaks the
property the bug breaks. ``lockstep.from_storage_oracle`` turns that trace into harness steps
under schedule points (``storage_step`` grants, ``schedule_point`` outcomes, the tree's calls),
and the scene records it on the reference, which keeps the property. So the suite carries the cases the checker proved
to be the nearest miss of each window, and an optimized tier replays them point by point: one
that carries the bug fails the vector (where the catalogue has a mutant of the bug, it does).
The traces are found again when the suite is generated (well under a second each), so they
follow the oracle. Registered after ``stories_windows.py``'s scenes.
"""

from __future__ import annotations

from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.storybook import Story

DEPTH_MAX = 40
"""Breadth-first bound of each world's search, in harness grants (each shortest trace is 1-29
oracle ops)."""

EXHAUSTIVE_WORLDS: dict[str, tuple[str, str, dict[str, object]]] = {
    "backup_ack_before_write": (
        "INV-32",
        "a backup's ack may be drained only after its page is in L3",
        {"ops": (("backup", 1),), "pages": 1, "preloaded": (0, 0)},
    ),
    "backup_skips_failed_batch": (
        "INV-31",
        "a backup stops at its first refused batch: L3 holds no page after a hole",
        {"ops": (("backup", 2),), "pages": 2, "preloaded": (0, 0)},
    ),
    "clear_wipes_every_namespace": (
        "INV-28",
        "one rank's clear empties its own namespace only",
        {"ops": (("backup", 1),), "pages": 1, "preloaded": (1, 1), "clear": True},
    ),
    "detach_with_work_in_flight": (
        "INV-24",
        "a detach finishes every operation in flight before its threads stop",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1), "detach": True},
    ),
    "hit_sync_per_batch": (
        "INV-20",
        "the hit query reduces once per prefetch, whatever each rank's run",
        {"ops": (("prefetch", 2),), "pages": 2, "preloaded": (2, 2)},
    ),
    "io_ignores_termination": (
        "INV-33",
        "the IO reads no batch of a prefetch after its check saw the termination",
        {"ops": (("prefetch", 2),), "pages": 2, "preloaded": (2, 2)},
    ),
    "io_counts_past_hole": (
        "INV-34",
        "one page of a batch comes back empty: progress stops before it",
        {"ops": (("prefetch", 2),), "pages": 2, "batch_pages": 2, "preloaded": (2, 2)},
    ),
    "io_raise_skips_final_ack": (
        "INV-25",
        "the backend raises inside the IO loop: still exactly one final ack",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
    ),
    "progress_not_reduced": (
        "INV-21",
        "the progress published is the MIN over ranks",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
    ),
    "reset_keeps_old_thread": (
        "INV-35",
        "a reset joins every thread: none of the old epoch runs again",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
    ),
    "terminate_releases_tail": (
        "INV-23",
        "a terminated prefetch's unpublished pages stay the IO's until its final ack",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
    ),
    "reset_keeps_release_queue": (
        "INV-24",
        "a reset empties the release queue: nothing of the old epoch is drained after it",
        {"ops": (("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
    ),
}
"""Planted oracle bug -> (the id the window's vector guards, its title, its two-rank world)."""


def exhaustive_story(flag: str) -> Story:
    """The story of ``flag``'s world: its shortest breaking interleaving, as harness steps."""
    from hicache_ref.formal.bounded_storage import explore_storage
    from hicache_ref.harness.lockstep.from_storage_oracle import (
        harness_config_for_storage,
        storage_steps_for_ops,
    )
    from hicache_ref.oracle.storage import OpSpec, StorageConfig, make_storage_variant

    inv, title, shape = EXHAUSTIVE_WORLDS[flag]
    ops = tuple(OpSpec(kind, pages) for kind, pages in shape["ops"])  # type: ignore[attr-defined]
    config = StorageConfig(
        variant=make_storage_variant(flag),
        ranks=2,
        **{**shape, "ops": ops},  # type: ignore[arg-type]
    )
    result = explore_storage(config, max_depth=DEPTH_MAX, lockstep=True)
    steps = storage_steps_for_ops(config, result.trace)
    note = f"the exhaustive checker's shortest trace of {flag} ({len(result.trace)} oracle ops)"

    def scene(r: Recorder) -> None:
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            r.apply(
                step.rule,
                dict(step.args),
                inv=inv if last else None,
                note=note if last else "",
            )

    vector_id = f"story-exhaustive-{flag.replace('_', '-')}"
    return Story(vector_id, title, inv, harness_config_for_storage(config), scene)


def exhaustive_stories() -> tuple[Story, ...]:
    return tuple(exhaustive_story(flag) for flag in EXHAUSTIVE_WORLDS)
