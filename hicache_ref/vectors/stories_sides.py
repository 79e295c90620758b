"""Scenes of an independent side pool (``pool_group="swa"``): a second pool of a group with its
own device rows and host slots (upstream 0.5.19+'s ``HostPoolGroup`` SWA entry; the reference's
``controller/side_pool.py``). Listed after the regression scenes, before the storage tier's.

Side-pool world: the stories' base world with one side layer more than the anchor's (a side
layer past the anchor's last has its own event), a side allocator of six pages and a side
host pool of four (so a second node's backup or load does not fit beside a first one), and the
draft pool of the world as the side pool.
"""

from __future__ import annotations

from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.storybook import backup, node_of, offload, reload, story

SIDES = {"pool_group": "swa", "draft_layer_num": 3, "side_device_pages": 6, "draft_host_pages": 4}


@story(
    "story-inv36-side-round-trip",
    "INV-36",
    "a node's side rows and slots come from the side pool's own allocators, both ways",
    **SIDES,
)
def _inv36_round_trip(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h}, inv="INV-36", note="side host slots from the side host pool")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write", inv="INV-06", note="both pools' host bytes")
    r.apply("evict_device", {"node": h}, note="the side rows go back to the side allocator")
    r.apply("load", {"node": h}, inv="INV-36", note="side rows from the side allocator")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-06", note="both pools' device bytes")


@story(
    "story-inv36-side-slots-never-shared",
    "INV-36",
    "two nodes backed up and reloaded: no side slot or row is handed out twice",
    **SIDES,
)
def _inv36_two_nodes(r: Recorder) -> None:
    a, b = node_of(r, 4), node_of(r, 2)
    offload(r, a)
    r.apply("write", {"node": b}, inv="INV-36", note="b's side slots: none of a's")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")
    reload(r, a, inv="INV-36")


@story(
    "story-inv17-side-host-short-write-refused",
    "INV-17",
    "a backup the side host pool cannot hold is refused whole: the anchor's slots go back",
    **SIDES,
)
def _inv17_side_write(r: Recorder) -> None:
    a = node_of(r, 6)  # three of the side host pool's four pages: two more do not fit
    backup(r, a)
    b = node_of(r, 4)
    r.apply("write", {"node": b}, inv="INV-17", note="refused: both pools as before")


@story(
    "story-inv17-side-rows-short-load-refused",
    "INV-17",
    "a load the side allocator cannot hold is refused whole: the anchor's rows go back",
    **SIDES,
)
def _inv17_side_load(r: Recorder) -> None:
    a = node_of(r, 6)
    offload(r, a)
    node_of(r, 8)  # four of the side allocator's six pages: three more do not fit
    r.apply("load", {"node": a}, inv="INV-17", note="refused: both allocators as before")


@story(
    "story-inv07-side-release-before-ack",
    "INV-07",
    "write, release the side host slots before the ack: refused",
    **SIDES,
)
def _inv07_side(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h})
    r.apply(
        "probe_evict_host", {"node": h}, inv="INV-07", note="its side D2H still writes the slots"
    )
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")
    r.apply("evict_device", {"node": h})
    r.apply("evict_host", {"node": h}, note="acked: both pools' slots go back")


@story(
    "story-inv11-side-layer-read-waits",
    "INV-11",
    "a read of a side layer past the anchor's last waits for that layer's own load",
    **SIDES,
)
def _inv11_side_tail(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply(
        "forward_read",
        {"node": h, "layer": 2, "draft": True},
        inv="INV-11",
        note="the side tail has its own event",
    )
    r.apply("synchronize", {"stream": "forward"}, inv="INV-11")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


STATES = {
    "pool_group": "mamba",
    "draft_layer_num": 2,
    "side_device_pages": 3,
    "draft_host_pages": 2,
}
"""A Mamba state pool: three device state slots and two host state slots (a node holds one)."""


@story(
    "story-inv40-state-slot-round-trip",
    "INV-40",
    "a node's state is one slot of the state pool's own, backed up and loaded with its KV",
    **STATES,
)
def _inv40_round_trip(r: Recorder) -> None:
    h = node_of(r, 8)  # two anchor pages, one state slot
    r.apply("write", {"node": h}, inv="INV-40", note="one host state slot beside 8 KV slots")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write", inv="INV-06", note="the state slot's host bytes")
    r.apply("evict_device", {"node": h}, note="the state slot goes back to its allocator")
    r.apply("load", {"node": h}, inv="INV-40", note="one device state slot beside 8 KV rows")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-06", note="the state loaded back is the one backed up")


@story(
    "story-inv17-state-host-full-write-refused",
    "INV-17",
    "a backup with no free host state slot is refused whole: the anchor's slots go back",
    **STATES,
)
def _inv17_state_write(r: Recorder) -> None:
    a, b = node_of(r, 4), node_of(r, 4)
    backup(r, a)
    backup(r, b)  # both host state slots held
    c = node_of(r, 4)
    r.apply("write", {"node": c}, inv="INV-17", note="refused: both pools as before")


@story(
    "story-inv09-state-cow-request-slot",
    "INV-09",
    "a load also copies the node's state into the request's own slot, drained with the load",
    **STATES,
    state_cow=True,
)
def _inv09_state_cow(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h}, note="the node's slot and the request's slot, one host state")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-09", note="the request's slot holds the node's state")
