"""What schedule points cost: one storage story without ``storage_points``, with them, with
page points too (``storage_page_points``: the IO also parks before each host page it writes),
and with lock points too (``storage_lock_points``: the reference's threads also park before each
look at an operation's termination; upstream's park there with points alone, so for upstream
that setting is the ``on+pages`` story again).

The story (two ranks, batches of one page): a chain of three pages backed up, its ack drained,
prefetched back (hit query, IO, sync) and its acks drained, then the case finished. Without
points each storage step runs one whole loop body; with points each runs one thread to its next
point, so the same work takes more steps. The script reports, per implementation and setting,
protocol steps per second and stories per second (the work done), medians over rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_schedule_points.py --rounds 5 --stories 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

KINDS = ("backup", "hit_query", "io", "sync")


SETTINGS = {
    "off": (False, False, False),
    "on": (True, False, False),
    "on+pages": (True, True, False),
    "on+pages+locks": (True, True, True),
}
"""Setting -> (``storage_points``, ``storage_page_points``, ``storage_lock_points``)."""


def story(impl: Implementation, setting: str) -> int:
    """One story; returns how many steps it applied."""
    points, pages, locks = SETTINGS[setting]
    config = impl.refine_config(
        HarnessConfig(
            host_pages=24,
            storage_ranks=2,
            storage_batch_pages=1,
            storage_points=points,
            storage_page_points=pages,
            storage_lock_points=locks,
        )
    )
    session = Session(config, impl, "bench")
    steps = 0

    def apply(rule: str, **args: Any) -> bool:
        nonlocal steps
        outcome = session.apply(Step(rule=rule, args=args))  # type: ignore[arg-type]
        steps += 1
        return not outcome.skipped

    def run(kind: str) -> None:
        storage = session.storage
        assert storage is not None
        while kind in [k.value for k in storage.runnable()]:
            apply("storage_step", kind=kind)

    apply("write_storage", pick=2, new=True)
    run("backup")
    apply("drain_backup_acks")
    apply("prefetch", pick=0)
    run("hit_query")
    apply("drain_prefetch_acks")
    run("io")
    run("sync")
    apply("drain_prefetch_acks")
    session.finish()
    return steps


def implementations() -> dict[str, Implementation]:
    from hicache_ref.harness.adapters.sglang import SglangImplementation
    from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree

    return {
        "reference": ReferenceImplementation(),
        "sglang 0.5.23": SglangImplementation(fetch_wheel_tree("0.5.23")),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stories", type=int, default=20)
    args = parser.parse_args()
    print("| implementation | points | steps per story | steps/s (median) | stories/s (median) |")
    print("|---|---|---:|---:|---:|")
    for name, impl in implementations().items():
        for setting in SETTINGS:
            story(impl, setting)  # warm-up
            step_rates, story_rates, per_story = [], [], 0
            for _ in range(args.rounds):
                start, steps = time.perf_counter(), 0
                for _ in range(args.stories):
                    per_story = story(impl, setting)
                    steps += per_story
                elapsed = time.perf_counter() - start
                step_rates.append(steps / elapsed)
                story_rates.append(args.stories / elapsed)
            print(
                f"| {name} | {setting} | {per_story} | "
                f"{statistics.median(step_rates):,.0f} | {statistics.median(story_rates):,.1f} |"
            )


if __name__ == "__main__":
    main()
