"""Hand-written vectors: at least one story per invariant id, each a short protocol scene.

A story is a function over a ``Recorder``: it applies steps (each must be enabled, or the
story is wrong and generation fails), marks the step whose expectation guards its invariant
(``inv=``) and says in ``note`` what happens. The recorder writes down what the reference
produced; the story only chooses the scene. ``STORIES`` lists them in id order; the suite
starts with them, so a broken implementation usually fails a story first, and its name says
what broke ("write, evict before the ack: refused").

Default world: MHA, two layers, two-token pages, three producer slots (upstream's own count,
so sglang replays the stories it has the capabilities for).
"""

from __future__ import annotations

from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.storybook import (
    Story,
    backup,
    compute,
    node_of,
    offload,
    prefill,
    record_story,
    reload,
    stories_in,
    story,
)

__all__ = ["STORIES", "record_story"]


# -- INV-01 .. INV-18 ---------------------------------------------------------------------------
@story("story-inv01-whole-pages", "INV-01", "write and load return whole, aligned pages")
def _inv01(r: Recorder) -> None:
    h = node_of(r, 3)
    r.apply("write", {"node": h}, inv="INV-01", note="host indices: whole pages")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")
    r.apply("evict_device", {"node": h})
    r.apply("load", {"node": h}, inv="INV-01", note="device indices: whole pages")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story("story-inv02-one-ack-per-write", "INV-02", "two writes, one ack each, in order")
def _inv02(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 4)
    r.apply("write", {"node": a}, inv="INV-02", note="one ack for node a")
    r.apply("write", {"node": b}, inv="INV-02", note="one ack for node b, behind a's")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_acks", inv="INV-02", note="both drain, once each")


@story(
    "story-inv02-second-backup-refused",
    "INV-02",
    "a second backup while the first is in flight: refused",
)
def _inv02_probe(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h})
    r.apply("probe_rewrite", {"node": h}, inv="INV-02", note="write again before the ack: refused")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv03-owners-replayed",
    "INV-03",
    "a CP load replays the owners recorded at write time",
    cp=True,
)
def _inv03(r: Recorder) -> None:
    h = node_of(r, 7)
    offload(r, h)
    r.apply("load", {"node": h}, inv="INV-03", note="fresh pages with the same owners")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-03", note="each rank's bytes on pages it owns")


@story(
    "story-inv04-per-layer-ack-after-last-layer",
    "INV-04",
    "an early CP reservation acks only after its last layer",
    cp=True,
    draft_layer_num=2,
    draft_host_pages=10,
)
def _inv04(r: Recorder) -> None:
    prefill(r, 5, early_reserve=True)
    r.apply("forward_layer", inv="INV-04", note="layer 0 stored and submitted: no ack yet")
    r.apply("forward_layer", inv="INV-04", note="the last layer (target and draft): the ack")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv04-load-ack-after-draft-tail",
    "INV-04",
    "a load ack waits for the draft layers past the target's",
    layer_num=1,
    draft_layer_num=2,
)
def _inv04_load(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply("drain_load", inv="INV-04", note="nothing has run: the ack is not finished")
    r.apply("forward_read", {"node": h, "layer": 1, "draft": True}, note="read the draft tail")
    r.apply("synchronize", {"stream": "forward"})
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-04", note="every layer landed: the ack drains")


@story(
    "story-inv05-host-full-then-freed",
    "INV-05",
    "fill the host, free a copy, fill it again",
    host_pages=3,
)
def _inv05(r: Recorder) -> None:
    a, b = node_of(r, 4), node_of(r, 4)
    backup(r, a)
    r.apply("write", {"node": b}, inv="INV-05", note="the host is full: refused, nothing held")
    r.apply("evict_device", {"node": a})
    r.apply("evict_host", {"node": a}, inv="INV-05", note="node a's host slots are free again")
    backup(r, b, inv="INV-05")


@story(
    "story-inv06-round-trip-mla",
    "INV-06",
    "an MLA round trip returns every byte",
    pool_kind="mla",
    layer_num=3,
)
def _inv06(r: Recorder) -> None:
    h = node_of(r, 5)
    offload(r, h)
    reload(r, h, inv="INV-06")


@story(
    "story-inv06-round-trip-nsa-draft",
    "INV-06",
    "an NSA round trip with a draft pool returns every byte",
    pool_kind="nsa",
    draft_layer_num=1,
    layout="page_first",
    io_backend="kernel",
)
def _inv06_draft(r: Recorder) -> None:
    h = node_of(r, 6)
    offload(r, h)
    reload(r, h, inv="INV-06")


@story(
    "story-inv07-evict-host-before-ack",
    "INV-07",
    "write, evict the host copy before the ack: refused",
)
def _inv07(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h})
    r.apply("probe_evict_host", {"node": h}, inv="INV-07", note="its D2H still writes the slots")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv07-scribble-while-writing",
    "INV-07",
    "the CPU writes free host slots while a D2H runs",
)
def _inv07_scribble(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h})
    r.apply("scribble_free_host", inv="INV-07", note="only free slots are touched")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write", inv="INV-07", note="the copy landed in its own slots only")


@story(
    "story-inv08-evict-device-while-loading",
    "INV-08",
    "evict a node's device pages while its load runs: refused",
)
def _inv08(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply("probe_evict_device", {"node": h}, inv="INV-08", note="the H2D still writes the pages")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story(
    "story-inv08-evict-device-while-writing",
    "INV-08",
    "evict a node's device pages while its D2H reads them: refused",
)
def _inv08_write(r: Recorder) -> None:
    h = node_of(r, 4)
    r.apply("write", {"node": h})
    r.apply("probe_evict_device", {"node": h}, inv="INV-08", note="the D2H still reads the pages")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv09-drain-only-finished", "INV-09", "acks drain only once their copies ran, in order"
)
def _inv09(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 2)
    r.apply("write", {"node": a})
    r.apply("write", {"node": b})
    r.apply("drain_write", inv="INV-09", note="nothing ran: nothing drains")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write", inv="INV-09", note="both ran: both drain, a first")


@story("story-inv09-load-drain-waits", "INV-09", "a load ack drains only after its H2D ran")
def _inv09_load(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply("drain_load", inv="INV-09", note="nothing ran: the node stays pinned")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-09", note="the bytes landed: it drains")


@story(
    "story-inv10-producer-slots",
    "INV-10",
    "loads fill the producer slots, drain, then reuse them",
    num_counters=2,
    host_pages=12,
    device_pages=12,
)
def _inv10(r: Recorder) -> None:
    nodes = [node_of(r, 2) for _ in range(3)]
    for h in nodes:
        offload(r, h)
    for h in nodes[:2]:
        r.apply("load", {"node": h})
        r.apply("start_loading", inv="INV-10", note="a free producer slot")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-10", note="both slots free again")
    r.apply("load", {"node": nodes[2]})
    r.apply("start_loading", inv="INV-10", note="a slot no undrained ack holds")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story(
    "story-inv11-read-waits-for-its-layer",
    "INV-11",
    "a forward read of a loading node waits for its layer",
)
def _inv11(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    r.apply("load", {"node": h})
    r.apply("start_loading")
    r.apply(
        "forward_read",
        {"node": h, "layer": 1, "draft": False},
        inv="INV-11",
        note="queued behind layer 1's event",
    )
    r.apply(
        "synchronize", {"stream": "forward"}, inv="INV-11", note="the read ran after layer 1 landed"
    )
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story(
    "story-inv11-batch-of-two-slots",
    "INV-11",
    "one forward batch reads nodes of two producer slots",
)
def _inv11_batch(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 2)
    offload(r, a)
    offload(r, b)
    for h in (a, b):
        r.apply("load", {"node": h})
        r.apply("start_loading")
    r.apply(
        "forward_read_batch",
        {"nodes": f"{a},{b}", "layer": 1, "draft": False},
        inv="INV-11",
        note="waits on both slots",
    )
    r.apply("synchronize", {"stream": "forward"})
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load")


@story(
    "story-inv12-backup-after-store",
    "INV-12",
    "a write issued right after the forward waits for the stores",
)
def _inv12(r: Recorder) -> None:
    h = prefill(r, 4)
    compute(r)
    r.apply("write", {"node": h}, note="the stores are still queued on the forward stream")
    r.apply("synchronize", {"stream": "write"}, note="the D2H runs after the stores")
    r.apply("drain_write", inv="INV-12", note="the host holds the stored bytes")


@story(
    "story-inv13-zero-owned-rank",
    "INV-13",
    "a node smaller than the CP group: one rank owns none of it",
    cp=True,
    cp_size=3,
    device_pages=12,
)
def _inv13(r: Recorder) -> None:
    h = node_of(r, 3)
    r.apply("write", {"node": h}, inv="INV-13", note="one host slot per owned position")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv14-ranks-ack-alike",
    "INV-14",
    "two nodes owned by different ranks ack alike everywhere",
    cp=True,
)
def _inv14(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 2)
    r.apply("write", {"node": a})
    r.apply("write", {"node": b})
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_acks", inv="INV-14", note="every rank drains a then b")
    offload_a = a
    r.apply("evict_device", {"node": offload_a})
    reload(r, a, inv="INV-14")


@story(
    "story-inv15-cancel-then-no-copy",
    "INV-15",
    "cancel a half-done per-layer backup: no later hook copies",
    cp=True,
)
def _inv15(r: Recorder) -> None:
    h = prefill(r, 4, early_reserve=True)
    r.apply("forward_layer", note="layer 0 stored and submitted")
    r.apply("cancel", {"node": h}, inv="INV-15", note="roll back; the host slots are freed")
    r.apply("forward_layer", inv="INV-15", note="layer 1's hook copies nothing, appends no ack")
    backup(r, h)


@story("story-inv16-acked-once-round-trip", "INV-16", "every write and load is acked exactly once")
def _inv16(r: Recorder) -> None:
    a, b = node_of(r, 2), node_of(r, 4)
    offload(r, a)
    r.apply("write", {"node": b})
    r.apply("load", {"node": a})
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "write"})
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_acks", inv="INV-16", note="one write ack and one load ack")


@story(
    "story-inv17-host-full-refused-clean",
    "INV-17",
    "a write refused for host capacity leaves nothing behind",
    host_pages=3,
)
def _inv17(r: Recorder) -> None:
    a, b = node_of(r, 4), node_of(r, 4)
    r.apply("write", {"node": a})
    r.apply("write", {"node": b}, inv="INV-17", note="host_capacity: refused, nothing held")
    r.apply("synchronize", {"stream": "write"})
    r.apply("drain_write")


@story(
    "story-inv17-draft-host-short",
    "INV-17",
    "a CP reservation refused because only the draft host pool is short",
    cp=True,
    draft_layer_num=1,
    draft_host_pages=1,
)
def _inv17_draft(r: Recorder) -> None:
    h = node_of(r, 8)
    r.apply("write", {"node": h}, inv="INV-17", note="draft_host_capacity: refused, nothing held")


@story(
    "story-inv17-device-full",
    "INV-17",
    "a prefill and a load refused for device capacity",
    device_pages=4,
)
def _inv17_device(r: Recorder) -> None:
    a = node_of(r, 4)
    offload(r, a)
    b = node_of(r, 6)
    r.apply("load", {"node": a}, inv="INV-17", note="device_capacity: refused, nothing held")
    r.apply("prefill", {"tokens": 4}, inv="INV-17", note="device_capacity: refused")
    r.apply("drop", {"node": b})
    reload(r, a)


@story(
    "story-inv18-reset-after-load",
    "INV-18",
    "reset after a load leaves no slot, ack or producer claimed",
)
def _inv18(r: Recorder) -> None:
    h = node_of(r, 4)
    offload(r, h)
    reload(r, h)
    r.apply("reset", inv="INV-18", note="the layer counter is reset too")
    node_of(r, 2)


@story(
    "story-inv18-reset-with-copies-queued", "INV-18", "reset with copies queued drains them first"
)
def _inv18_in_flight(r: Recorder) -> None:
    a, b = node_of(r, 4), node_of(r, 2)
    r.apply("write", {"node": a})
    node_of(r, 2)
    r.apply("reset_in_flight", inv="INV-18", note="no queued copy lands after the reset")
    del b
    node_of(r, 4)


# the bug-class and regression scenes, the side pool's, then the storage tier's (INV-19 .. INV-35),
# the side pool's window in L3 (INV-39), buffer mode (INV-41) and the exhaustive checker's nearest
# misses of each window
from hicache_ref.vectors import (  # noqa: E402
    stories_buffer,
    stories_regressions,
    stories_side_storage,
    stories_sides,
    stories_storage,
    stories_windows,
)
from hicache_ref.vectors.stories_exhaustive import exhaustive_stories  # noqa: E402

STORIES: tuple[Story, ...] = (
    *stories_in(globals()),
    *stories_in(vars(stories_regressions)),
    *stories_in(vars(stories_sides)),
    *stories_in(vars(stories_storage)),
    *stories_in(vars(stories_side_storage)),
    *stories_in(vars(stories_buffer)),
    *stories_in(vars(stories_windows)),
    *exhaustive_stories(),
)
"""Every story, in the order the suite records them."""
