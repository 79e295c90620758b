"""Scenes aimed at bug classes the campaigns found, and regression scenes of the reference's
own schedule (``ops``: a load ack observed op by op). Listed after ``stories.py``'s."""

from __future__ import annotations

from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.storybook import (
    BASE,
    Story,
    node_of,
    offload,
    prefill,
    story,
)


# -- scenes aimed at bug classes the campaigns found -------------------------------------------
@story(
    "story-draft-tail-read-waits",
    "INV-11",
    "a read of a draft layer past the target's waits for it",
    layer_num=1,
    draft_layer_num=2,
)
def _draft_tail(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply(
        "forward_read",
        {"node": h, "layer": 1, "draft": True},
        inv="INV-11",
        note="the tail has its own event",
    )
    r.apply("synchronize", {"stream": "forward"}, inv="INV-11")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story(
    "story-two-loads-one-slot",
    "INV-16",
    "two nodes loaded in one start_loading: one ack names both",
    host_pages=24,
    device_pages=40,
    num_counters=16,
)
def _two_loads(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 4)
    offload(r, a)
    offload(r, b)
    r.apply("load", {"node": a})
    r.apply("load", {"node": b})
    r.apply("start_loading", inv="INV-16", note="one ack for both")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-16", note="both unpinned")


@story(
    "story-reuse-freed-pages-lifo",
    "INV-11",
    "a load reuses pages whose stores are still queued",
    alloc_policy="lifo",
    settle_records=True,
)
def _reuse(r: Recorder) -> None:
    a = node_of(r, 4)
    offload(r, a)
    b = prefill(r, 4)
    r.apply("forward_layer")
    r.apply("drop", {"node": b}, note="an aborted request: its stores stay queued")
    r.apply("load", {"node": a}, note="the freed pages come back at once")
    r.apply("start_loading")
    r.apply("forward_read", {"node": a, "layer": 0, "draft": False}, inv="INV-11")
    r.apply("synchronize", {"stream": "forward"})
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-09")


@story(
    "story-cp-pending-write-not-reserved-twice",
    "INV-02",
    "a node with a pending per-layer write is not reserved again",
    cp=True,
)
def _cp_pending(r: Recorder) -> None:
    h = prefill(r, 4, early_reserve=True)
    r.apply("forward_layer")
    r.apply("probe_rewrite", {"node": h}, inv="INV-02", note="refused: the first backup is pending")
    r.apply("forward_layer")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


# -- regression scenes of the reference's own schedule (``ops``) --------------------------------
def _load_ack_scene(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "forward"}, note="the forward's queued work runs")
    for _ in range(64):  # bounded: a load of a few layers is a few dozen ops
        if not r.session.world.ranks[0].controller.ack_load_queue:
            return
        r.apply("advance", {"stream": "load", "n": 1}, note="one more op of the load")
        r.apply("drain_load", inv="INV-04", note="the ack drains only once every layer landed")
    raise AssertionError(f"{r.vector_id}: the load never drained")


def _ops_story(vector_id: str, title: str, **config: object) -> Story:
    world = HarnessConfig.model_validate({**BASE.model_dump(), **config})
    return Story(vector_id, title, "INV-04", world, _load_ack_scene, settle=False)


OPS_LOAD_ACK_AFTER_LAST_LAYER = _ops_story(
    "story-ops-load-ack-after-last-layer", "the load ack of three layers, op by op", layer_num=3
)
OPS_LOAD_ACK_AFTER_DRAFT_TAIL = _ops_story(
    "story-ops-load-ack-after-draft-tail",
    "a load ack with a draft tail, op by op",
    layer_num=1,
    draft_layer_num=2,
)
