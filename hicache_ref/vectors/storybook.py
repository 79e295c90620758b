"""How a story is written: the ``Story`` record, the ``story`` decorator that makes a scene a
``Story`` (``stories_in`` finds a module's stories in the order they are written), the verbs
scenes share (prefill -> compute -> backup / offload -> reload), and ``record_story``, which
records a scene on the reference. The scenes are in ``stories.py``, which lists ``STORIES``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.vectors.record import Recorder

BASE = HarnessConfig(
    page_size=2, layer_num=2, device_pages=10, host_pages=10, num_counters=3, seed=7
)
CP2 = BASE.model_copy(update={"pool_kind": "nsa", "cp_size": 2, "device_pages": 12})


@dataclass(frozen=True)
class Story:
    id: str
    title: str
    inv: str
    config: HarnessConfig
    scene: Callable[[Recorder], None]
    settle: bool = True  # False: an ``ops`` scene (the reference's own schedule)


def story(
    vector_id: str, inv: str, title: str, **config: object
) -> Callable[[Callable[[Recorder], None]], Story]:
    """The decorated scene as a ``Story`` of ``vector_id`` guarding ``inv``, in the stories' base
    world with ``config`` over it (``cp=True``: the two-rank CP world)."""
    base = CP2 if config.pop("cp", False) else BASE
    world = HarnessConfig.model_validate({**base.model_dump(), **config})

    def make(scene: Callable[[Recorder], None]) -> Story:
        return Story(vector_id, title, inv, world, scene)

    return make


def stories_in(namespace: Mapping[str, object]) -> tuple[Story, ...]:
    """A module's stories (``vars(module)``), in the order the module defines them."""
    return tuple(value for value in namespace.values() if isinstance(value, Story))


# -- verbs the stories share --------------------------------------------------------------------
def prefill(r: Recorder, tokens: int, **kw: object) -> int:
    handle = r.session.tree.next_handle
    r.apply("prefill", {"tokens": tokens, **kw}, note=f"prefill node {handle} ({tokens} tokens)")  # type: ignore[dict-item]
    return handle


def compute(r: Recorder) -> None:
    while r.session.tree.batch:
        r.apply("forward_layer", note="the forward stores one layer of the batch")


def node_of(r: Recorder, tokens: int) -> int:
    handle = prefill(r, tokens)
    compute(r)
    return handle


def backup(r: Recorder, handle: int, inv: str | None = None) -> None:
    r.apply("write", {"node": handle}, note=f"write node {handle}")
    r.apply("synchronize", {"stream": "write"}, note="the write stream runs dry")
    r.apply("drain_write", inv=inv, note="writing_check drains the ack; host bytes checked")


def offload(r: Recorder, handle: int) -> None:
    backup(r, handle)
    r.apply("evict_device", {"node": handle}, note=f"evict node {handle}'s device pages")


def reload(r: Recorder, handle: int, inv: str | None = None) -> None:
    r.apply("load", {"node": handle}, note=f"load node {handle} back")
    r.apply("start_loading", note="one producer slot for the queued loads")
    r.apply("synchronize", {"stream": "load"}, note="the load stream runs dry")
    r.apply("drain_load", inv=inv, note="loading_check drains the ack; device bytes checked")


def record_story(s: Story) -> Recorder:
    """The story's scene, recorded on the reference (``Recorder.vector`` seals it)."""
    recorder = Recorder(s.config, vector_id=s.id, title=s.title, kind="story", settle=s.settle)
    s.scene(recorder)
    return recorder
