"""The reset family: the tree starts over, at idle or with copies still queued; and a noop.

``reset`` (the device runs to idle, then every controller resets, the pools clear and node ids
restart at 0) -> ``reset_in_flight`` (capability ``reset_drains``: the controllers reset with
their copies queued, and every free page and slot is poisoned, so a copy that lands after the
reset is caught) ; ``noop`` (an oracle op with no call). A storage world's L3 side resets with
the tree (``StorageDriver.on_reset``: peers reset, a new epoch). The session runs the reset
checks (INV-18) after each (``resets``).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.record import (
    RESET_DRAINS,
    Args,
    Completion,
    Draw,
    OracleView,
    RuleRecord,
    StepContext,
    always,
    copies_queued,
    device_busy,
    no_args,
    no_oracle_ops,
)
from hicache_ref.harness.step_types import Outcome, StepArg, done
from hicache_ref.oracle import ops as o

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver


def reset_world(tree: TreeDriver, storage: StorageDriver | None) -> None:
    """Every controller reset, the pools cleared, the tree's nodes and watches forgotten."""
    for rank in tree.world.ranks:
        rank.controller.reset()
        rank.host_pool.clear()
        rank.allocator.clear()
        if rank.draft_host_pool is not None:
            rank.draft_host_pool.clear()
        if rank.side_allocator is not None:
            rank.side_allocator.clear()
    tree.nodes.clear()
    tree.ongoing_write.clear()
    tree.ongoing_load.clear()
    tree.queued_loads.clear()
    tree.batch, tree.batch_layer = [], 0
    tree.next_node_id = 0
    tree.watch.clear()
    tree.stores.clear()
    if storage is not None:
        storage.on_reset()  # the storage peers and the L3 records of the old epoch


def _offered_reset(ctx: StepContext) -> bool:
    return len(ctx.tree.nodes) >= 3


def _oracle_reset(view: OracleView, args: Args, outcome: Outcome) -> list[o.Op]:
    return [o.Reset()]


# -- reset --------------------------------------------------------------------------------------
def reset(tree: TreeDriver, storage: StorageDriver | None) -> Outcome:
    """Tree reset at idle: controller reset, pools cleared, node ids restart at 0."""
    tree.world.device.run_until_idle()
    reset_world(tree, storage)
    return done("reset")


def process_reset(ctx: StepContext, args: Args) -> Outcome:
    return reset(ctx.tree, ctx.storage)


RESET = RuleRecord(
    "reset",
    "other",
    "tree reset at idle",
    always,
    process_reset,
    draw=Draw({}, no_args, _offered_reset),
    oracle=_oracle_reset,
    feeds_first=True,  # the tree runs the device to idle first
    weight=1,
    resets=True,
    walk=1.0,
)


# -- reset_in_flight ----------------------------------------------------------------------------
def _rule_reset_in_flight(ctx: StepContext, args: Args) -> str | None:
    if RESET_DRAINS not in ctx.capabilities:
        return "reset() does not wait for its streams here (no reset_drains): use reset"
    return None if device_busy(ctx) else "no copy is queued (use reset)"


def reset_in_flight(tree: TreeDriver, storage: StorageDriver | None) -> Outcome:
    """Tree reset while copies are queued (capability ``reset_drains``): the forward batch
    at hand finishes, then every controller resets with its write and load copies still
    queued. Every free page and slot is then poisoned: a copy that lands after the reset
    (the reset did not wait for its streams) is caught in pages about to be reused."""
    tree.world.forward_stream.synchronize()
    queued = not tree.world.device.is_idle()
    reset_world(tree, storage)
    why = (
        "a copy queued before reset() landed after it (reset must synchronize the write "
        "and load streams before clearing its queues)"
    )
    pages = tree.watch.poison_free("device", "INV-18", why)
    slots = tree.watch.poison_free("host", "INV-18", why)
    return done(f"reset with copies {'queued' if queued else 'done'}; poisoned {pages} + {slots}")


def process_reset_in_flight(ctx: StepContext, args: Args) -> Outcome:
    return reset_in_flight(ctx.tree, ctx.storage)


RESET_IN_FLIGHT = RuleRecord(
    "reset_in_flight",
    "other",
    "tree reset with copies queued (the implementation's reset must drain its streams)",
    _rule_reset_in_flight,
    process_reset_in_flight,
    draw=Draw(
        {},
        no_args,
        lambda s: RESET_DRAINS in s.capabilities and _offered_reset(s) and copies_queued(s),
    ),
    oracle=_oracle_reset,
    feeds_first=True,
    resets=True,
    completion=Completion(in_flight=("write", "load")),
    walk=2.0,
)


# -- noop ---------------------------------------------------------------------------------------
def _sample_noop(ctx: StepContext, rng: random.Random) -> dict[str, StepArg] | None:
    return {}


NOOP = RuleRecord(
    "noop",
    "other",
    "nothing (an oracle op with no call)",
    always,
    lambda ctx, args: done("noop"),
    oracle=no_oracle_ops,
    walk=0.2,
    sample=_sample_noop,
)

RECORDS: tuple[RuleRecord, ...] = (RESET, RESET_IN_FLIGHT, NOOP)
