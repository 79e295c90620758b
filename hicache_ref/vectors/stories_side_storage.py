"""Scenes of an independent side pool's window in L3 (INV-39): stored with its node, read back
all-or-nothing with the KV pages, and loaded back with the prefetched node.

Side-storage world: the storage tier's default world (``stories_storage.STORAGE_WORLD``: two
ranks, one-page batches) with an independent side pool, its window covering a three-page
chain, so the prefetched node keeps the window as its side slots; under host pressure a
prefetch's pick 8 has other requests leave every rank two host pages, so a three-page hit is
served cut to two; the Mamba world's window is the node's one state page, under its last page
key. Listed after the storage tier's scenes.
"""

from __future__ import annotations

from hicache_ref.vectors.record import Recorder
from hicache_ref.vectors.stories_storage import STORAGE_WORLD, hit, run_storage, to_l3
from hicache_ref.vectors.storybook import story

SIDE_STORAGE: dict[str, object] = {
    **STORAGE_WORLD,
    "pool_group": "swa",
    "draft_layer_num": 1,
    "side_device_pages": 6,
    "draft_host_pages": 12,
    "storage_swa_window": 3,
    "storage_policy": "wait_complete",
}
MAMBA_STORAGE: dict[str, object] = {**SIDE_STORAGE, "pool_group": "mamba", "storage_swa_window": 1}


def round_trip(r: Recorder) -> None:
    """A three-page chain to L3 with its window, fetched back, its node loaded to device."""
    uid = to_l3(r, pick=2)
    hit(r, inv="INV-29", note="the longest prefix whose window every rank's L3 holds")
    run_storage(r, inv="INV-39", note="the window read after every KV page, kept whole")
    r.apply("load", {"node": uid}, note="the prefetched node to device, its window too")
    r.apply("start_loading")
    r.apply("synchronize", {"stream": "load"})
    r.apply("drain_load", inv="INV-06", note="device bytes: the chain's own, both pools")


@story(
    "story-inv39-swa-window-round-trips-through-l3",
    "INV-39",
    "a chain's SWA pages go to L3 beside its KV pages and come back as its node's window",
    **SIDE_STORAGE,
)
def _inv39_swa(r: Recorder) -> None:
    round_trip(r)


@story(
    "story-inv39-a-cut-hit-reads-the-served-hits-window",
    "INV-39",
    "a hit cut to the host room reads the window of the pages served, the staged rest given back",
    **{**SIDE_STORAGE, "storage_host_pressure": True},
)
def _inv39_cut(r: Recorder) -> None:
    to_l3(r, pick=2)
    r.apply("prefetch", {"pick": 8}, note="other requests leave every rank two host pages")
    r.apply("storage_step", {"kind": "hit_query"}, note="a three-page hit, window included")
    r.apply("drain_prefetch_acks", note="served cut to two pages; three window pages staged")
    run_storage(r, inv="INV-39", note="the window of pages 1-2 read, the third page given back")


@story(
    "story-inv39-mamba-state-round-trips-through-l3",
    "INV-39",
    "a node's one Mamba state page goes to L3 under its last page key and comes back with it",
    **MAMBA_STORAGE,
)
def _inv39_mamba(r: Recorder) -> None:
    round_trip(r)
