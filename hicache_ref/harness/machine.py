"""The Hypothesis state machine: rules named after protocol verbs, all applied through a Session.

Each case draws a configuration the implementation supports, then a program of rules. The
atomic machine rules are generated from the rule records (``rules.RULES``: every record with a
``draw``), one method per record named after it, whose precondition is the record's ``offered``
and whose arguments are the record's strategies; the session then checks the step against the
same record. Rules pick nodes among the candidates the session offers (``@precondition`` keeps
impossible rules out; no ``assume``), and mirror nothing in bundles: the session holds the
state, so invariants and preconditions can see it. Compound rules compose atomic steps:
``prefill`` (and compute), ``forward_layer`` (all layers), ``drain_acks`` (maybe flush writes
first), ``offload``, ``cancel_and_reuse``, ``reload``, ``reload_staggered`` and
``round_trip``; ``prefill`` and ``round_trip`` are always valid, so swarm testing never leaves
a case with nothing to do, and the reload compounds keep the load path, where shipped
corruption lives, above a fifth of the applied steps (``LOAD_PATH_SHARE_MIN``). After every
step the session checks its invariants; teardown runs the quiescence checks. When a case
fails, the machine hands its trace to the class's ``sink``, and notes the line that replays it.

Nothing is shared through module globals: ``machine_for(implementation, name, sink)`` binds the
implementation and a ``CaseSink`` (a campaign's: it counts every finished case and keeps the
failing traces where that campaign wants them) to a fresh machine class. Without one, failing
traces go to ``fuzz/out/`` (``FailureFolder``), as for the machines pytest runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from hicache_ref.harness.adapters.base import Implementation, supports
from hicache_ref.harness.config import (
    LEGAL_LAYOUTS,
    MHA_ONLY_LAYOUTS,
    HarnessConfig,
    IoBackend,
    Layout,
    PoolKind,
)
from hicache_ref.harness.lockstep import attach_lockstep
from hicache_ref.harness.rules import RULES, RuleRecord
from hicache_ref.harness.session import Session
from hicache_ref.harness.trace import Step, Trace
from hicache_ref.pools.transfer import copy_paths_for_layout
from hicache_ref.replay_lines import get_replay_line

DEFAULT_FAILURE_DIR = Path("fuzz/out")
DRAWN_COPY_PATHS = ("gather", "runs", "batch")
"""Copy paths a case draws: the simulator's gather, and the two GPU paths (run-merged copies,
the copy engine's batched page copies, executed on the CPU by ``memmove`` from the same pointer
plan). ``triton`` is left to the transfer tests: its CPU interpreter is too slow per step."""
LOAD_PATH_SHARE_MIN = 0.20  # of applied steps, on the reference (tests/harness/test_rules.py)


class CaseSink(Protocol):
    """What a machine hands the campaign that runs it."""

    def on_case(self, session: Session) -> None:
        """A case finished without failing (its stats feed the campaign's report)."""

    def on_failure(self, trace: Trace) -> Path:
        """A case failed: keep its trace and say where (Hypothesis may re-run it many times)."""


@dataclass
class FailureFolder:
    """The sink of a machine no campaign runs: ``folder/failure-<impl>.jsonl``, rewritten by
    each failing run (Hypothesis shows the note of the final, shrunk run only)."""

    folder: Path = DEFAULT_FAILURE_DIR
    last_failure: Path | None = field(default=None, compare=False)

    def on_case(self, session: Session) -> None:
        return None

    def on_failure(self, trace: Trace) -> Path:
        name = trace.header.implementation.replace(":", "-")
        self.last_failure = trace.write(self.folder / f"failure-{name}.jsonl")
        return self.last_failure


@st.composite
def harness_configs(draw: st.DrawFn, capabilities: frozenset[str] = frozenset()) -> HarnessConfig:
    """Configurations drawn per case, restricted to what the implementation supports."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    io_backend: IoBackend = draw(st.sampled_from(["direct", "kernel"]))
    layout: Layout = draw(st.sampled_from(LEGAL_LAYOUTS[io_backend]))
    mha_only = layout in MHA_ONLY_LAYOUTS
    layout_paths = copy_paths_for_layout(layout)  # the copy engine's batch refuses some layouts
    cp_size = 0 if mha_only else draw(st.sampled_from([0, 0, 1, 2, 3, 4]))
    pool_kind: PoolKind = (
        "mha" if mha_only else "nsa" if cp_size else draw(st.sampled_from(["mha", "mla", "nsa"]))
    )
    layer_num = draw(st.integers(1, 3))
    draft_layer_num = draw(st.sampled_from([0, 0, layer_num - 1, layer_num + 1]))
    ranks = max(1, cp_size)
    config = HarnessConfig(
        page_size=page_size,
        layer_num=layer_num,
        draft_layer_num=max(0, draft_layer_num),
        pool_kind=pool_kind,
        layout=layout,
        io_backend=io_backend,
        cp_size=cp_size,
        device_pages=draw(st.integers(2 * ranks + 6, 2 * ranks + 40)),
        host_pages=draw(st.integers(2, 24)),
        alloc_policy=draw(st.sampled_from(["fifo", "lifo", "random"])),
        draft_alloc_policy=draw(st.sampled_from(["fifo", "lifo", "random"])),
        draft_host_pages=draw(st.integers(1, 24)) if cp_size and draft_layer_num > 0 else 0,
        num_counters=draw(st.sampled_from([2, 5])),
        settle_records=draw(st.booleans()),
        copy_path=draw(st.sampled_from([p for p in DRAWN_COPY_PATHS if p in layout_paths])),
        hybrid=draw(st.sampled_from([False, False, True])),
        seed=draw(st.integers(0, 2**16)),
    )
    if capabilities and not supports(capabilities, config):
        return draw(st.nothing())
    return config


def _draw_config(implementation: Implementation, data: st.DataObject) -> HarnessConfig:
    config = data.draw(harness_configs(implementation.capabilities))
    refine = getattr(implementation, "refine_config", None)
    if refine is None:
        return config
    refined: HarnessConfig = refine(config)
    # a refinement is a model_copy, which skips validation: validate the world it asks for
    try:
        refined = HarnessConfig.model_validate(refined.model_dump())
    except ValueError:
        reject()  # e.g. a focus that turns on CP for an MHA-only layout: draw another
    if not supports(implementation.capabilities, refined):
        reject()
    return refined


class HiCacheMachine(RuleBasedStateMachine):
    """Drives one implementation through write, load, cancel and evict interleavings."""

    implementation: Implementation
    impl_name = "reference"
    sink: ClassVar[CaseSink] = FailureFolder()

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None
        self.failed = False

    @property
    def s(self) -> Session:
        assert self.session is not None, "initialize() draws the configuration first"
        return self.session

    def _apply(self, rule_name: str, **args: Any) -> None:
        try:
            self.s.apply(Step(rule=rule_name, args=args))  # type: ignore[arg-type]
        except Exception as exc:
            self.failed = True  # teardown must not replace this error with a consequence
            self._report_failure(exc)
            raise
        except KeyboardInterrupt:
            self.failed = True  # Ctrl-C cut the step short: its half-done state proves nothing
            raise

    def _report_failure(self, exc: BaseException) -> None:
        """Hand this case's trace to the sink and note the replay line.

        Hypothesis shrinks by re-running failing cases; the sink keeps the latest, and a note is
        shown only for the final (shrunk) run, so exactly one line is printed.
        """
        if self.session is None or getattr(exc, "_hicache_reported", False):
            return
        trace = self.s.trace(note=f"{type(exc).__name__}: {exc}"[:500])
        path = self.sink.on_failure(trace)
        note(
            f"hicache_ref: {len(trace.steps)}-step failure ({type(exc).__name__}); "
            f"replay with: {get_replay_line(path)}"
        )
        exc._hicache_reported = True  # type: ignore[attr-defined]

    def _pick(self, rule_name: str, pick: int) -> int:
        candidates = self.s.candidates(rule_name)
        return candidates[pick % len(candidates)]

    def _has(self, rule_name: str) -> bool:
        return self.session is not None and bool(self.session.candidates(rule_name))

    @initialize(config=st.data())
    def setup(self, config: st.DataObject) -> None:
        drawn = _draw_config(self.implementation, config)
        self.session = Session(drawn, self.implementation, self.impl_name)
        attach_lockstep(self.session)  # the pure oracle follows every step

    @rule(tokens=st.integers(1, 40), early_reserve=st.booleans(), compute_now=st.booleans())
    def prefill(self, tokens: int, early_reserve: bool, compute_now: bool) -> None:
        """A request's prefill: new pages; with ``compute_now`` the forward runs every layer."""
        self._apply("prefill", tokens=tokens, early_reserve=early_reserve and self.s.config.uses_cp)
        while compute_now and self.s.tree.batch:
            self._apply("forward_layer")

    @precondition(lambda self: self.session is not None and bool(self.s.tree.batch))
    @rule(all_layers=st.booleans())
    def forward_layer(self, all_layers: bool) -> None:
        self._apply("forward_layer")
        while all_layers and self.s.tree.batch_layer > 0:
            self._apply("forward_layer")

    @precondition(lambda self: self._has("write"))
    @rule(pick=st.integers(0, 63))
    def offload(self, pick: int) -> None:
        """Compound: write -> host syncs the write stream -> drain -> evict_device (atomic steps)."""
        node = self._pick("write", pick)
        self._apply("write", node=node)
        self._apply("synchronize", stream="write")
        self._apply("drain_acks")
        if node in self.s.candidates("evict_device"):
            self._apply("evict_device", node=node)

    @precondition(lambda self: self._has("load"))
    @rule(
        picks=st.lists(st.integers(0, 63), min_size=1, max_size=3),
        reads=st.integers(1, 6),
        run_ops=st.integers(0, 6),
        drain=st.booleans(),
    )
    def reload(self, picks: list[int], reads: int, run_ops: int, drain: bool) -> None:
        """Compound: load up to three nodes -> one start_loading (their ops merged) -> forward
        reads of the loading nodes at once (they must wait on the per-layer events) -> part of
        the H2D runs -> maybe drain (atomic steps)."""
        loaded = self._load_some(picks)
        self._start_and_read(loaded, reads, run_ops, drain)

    @rule(
        pick=st.integers(0, 63),
        cycles=st.integers(1, 3),
        reads=st.integers(1, 6),
        run_ops=st.integers(0, 6),
        tokens=st.integers(1, 40),
    )
    def round_trip(self, pick: int, cycles: int, reads: int, run_ops: int, tokens: int) -> None:
        """Compound: a device node goes to host and comes back, ``cycles`` times: (a new node's
        prefill and forward when none is ready) -> write -> sync -> drain -> (evict_device ->
        load -> start_loading -> reads while it loads -> part of the H2D -> sync -> drain_load)
        x cycles (atomic steps)."""
        if not (self._has("write") or self._has("evict_device")):
            self.prefill(tokens, early_reserve=False, compute_now=True)
        if not (self._has("write") or self._has("evict_device")):
            return  # the device is full: the prefill was refused
        if self._has("write"):
            node = self._pick("write", pick)
            self._apply("write", node=node)
            self._apply("synchronize", stream="write")
            self._apply("drain_acks")
        else:
            node = self._pick("evict_device", pick)
        for cycle in range(cycles):
            if node not in self.s.candidates("evict_device"):
                return
            self._apply("evict_device", node=node)
            if node not in self.s.candidates("load"):
                return
            self._apply("load", node=node)
            self._start_and_read([node], reads, run_ops, drain=False)
            if cycle + 1 < cycles:
                self._apply("synchronize", stream="load")
                self._apply("drain_load")

    def _load_some(self, picks: list[int]) -> list[int]:
        loaded: list[int] = []
        for pick in picks:
            if self._has("load"):
                node = self._pick("load", pick)
                self._apply("load", node=node)
                loaded.append(node)
        return loaded

    def _start_and_read(self, loaded: list[int], reads: int, run_ops: int, drain: bool) -> None:
        if self.s.is_enabled(Step(rule="start_loading")):
            self._apply("start_loading")
        config = self.s.config
        kinds = [(False, config.layer_num)] + ([(True, config.draft_layer_num)] * config.has_draft)
        for i in range(reads if loaded else 0):
            node = loaded[i % len(loaded)]
            draft, layer_num = kinds[(i // len(loaded)) % len(kinds)]
            layer = (i // (len(loaded) * len(kinds))) % layer_num
            if node in self.s.candidates("forward_read"):
                self._apply("forward_read", node=node, layer=layer, draft=draft)
        if run_ops:
            self._apply("advance", stream="load", n=run_ops)
            self._apply("advance", stream="forward", n=run_ops)
        if drain:
            self._apply("drain_load")

    @precondition(lambda self: self._has("cancel"))
    @rule(pick=st.integers(0, 63), run_ops=st.integers(0, 8))
    def cancel_and_reuse(self, pick: int, run_ops: int) -> None:
        """Compound: roll back a pending per-layer backup (its host slots are freed) -> the CPU
        scribbles every free host slot while copies are queued -> part of the write stream
        runs (a copy still writing a freed slot overwrites the scribble) (atomic steps)."""
        self._apply("cancel", node=self._pick("cancel", pick))
        if self.s.is_enabled(Step(rule="scribble_free_host")):
            self._apply("scribble_free_host")
        if run_ops:
            self._apply("advance", stream="write", n=run_ops)

    @precondition(lambda self: self._has("load"))
    @rule(
        picks=st.lists(st.integers(0, 63), min_size=2, max_size=3),
        reads=st.integers(1, 6),
        run_ops=st.integers(0, 6),
        drain=st.booleans(),
    )
    def reload_staggered(self, picks: list[int], reads: int, run_ops: int, drain: bool) -> None:
        """Compound: up to three nodes, each loaded by its own start_loading (a producer slot
        each) -> forward reads of all of them in one batch (``forward_read_batch``: one wait
        that must cover every slot's layer event; one read per node without
        ``multi_consumer``) -> part of the H2D runs -> maybe drain (atomic steps)."""
        loaded: list[int] = []
        for pick in picks:
            if self._has("load"):
                node = self._pick("load", pick)
                self._apply("load", node=node)
                loaded.append(node)
                if self.s.is_enabled(Step(rule="start_loading")):
                    self._apply("start_loading")
        config = self.s.config
        kinds = [(False, config.layer_num)] + ([(True, config.draft_layer_num)] * config.has_draft)
        for i in range(reads if len(loaded) >= 2 else 0):
            draft, layer_num = kinds[i % len(kinds)]
            layer = (i // len(kinds)) % layer_num
            batch = Step(
                rule="forward_read_batch",
                args={"nodes": ",".join(map(str, loaded)), "layer": layer, "draft": draft},
            )
            if self.s.is_enabled(batch):
                self._apply("forward_read_batch", **batch.args)
                continue
            for node in loaded:
                single = Step(
                    rule="forward_read", args={"node": node, "layer": layer, "draft": draft}
                )
                if self.s.is_enabled(single):
                    self._apply("forward_read", **single.args)
        if run_ops:
            self._apply("advance", stream="load", n=run_ops)
            self._apply("advance", stream="forward", n=run_ops)
        if drain:
            self._apply("drain_load")

    @precondition(
        lambda self: (
            self.session is not None and bool(self.s.tree.ongoing_write or self.s.tree.ongoing_load)
        )
    )
    @rule(start_writing=st.booleans())
    def drain_acks(self, start_writing: bool) -> None:
        """The scheduler's per-step check: maybe flush queued writes, then drain both queues."""
        if start_writing:
            self._apply("start_writing")
        self._apply("drain_acks")

    def teardown(self) -> None:
        if self.session is None or self.failed:
            return
        try:
            self.session.finish()
        except Exception as exc:
            self._report_failure(exc)
            raise
        finally:
            self.sink.on_case(self.session)  # its steps ran, whether quiescence held or not


def _atomic_rule(record: RuleRecord) -> Callable[..., None]:
    """The machine rule of one atomic record: draw its strategies, choose, apply."""
    draw = record.draw
    assert draw is not None, f"rule {record.name} has no draw"

    def apply_record(self: HiCacheMachine, **drawn: Any) -> None:
        args = draw.choose(self.s, drawn)
        if args is not None:
            self._apply(record.name, **args)

    apply_record.__name__ = apply_record.__qualname__ = record.name
    apply_record.__doc__ = f"Atomic ({record.family}): {record.doc}."
    offered = draw.offered
    strategies: dict[str, st.SearchStrategy[Any]] = dict(draw.strategies)
    ruled = rule(**strategies)(apply_record)  # type: ignore[call-overload]  # (a dict of kwargs)
    guarded = precondition(lambda self: self.session is not None and offered(self.s))(ruled)
    return guarded  # type: ignore[no-any-return]


for _record in RULES.values():
    if _record.draw is not None:
        # Verify a generated rule does not hide a compound rule of the same name
        assert _record.name not in HiCacheMachine.__dict__, f"{_record.name}: compound or atomic?"
        setattr(HiCacheMachine, _record.name, _atomic_rule(_record))


def machine_for(
    implementation: Implementation, name: str, sink: CaseSink | None = None, *, key: str = ""
) -> type[HiCacheMachine]:
    """A machine class bound to one implementation and the sink of the campaign running it.

    The class name is Hypothesis' example-database key for its failures; ``key`` (a digest of
    the implementation's source, say) keeps two trees gated under one name apart there.
    """
    slug = name.replace(":", "_").replace("-", "_").replace(".", "_")
    attributes: dict[str, Any] = {"implementation": implementation, "impl_name": name}
    if sink is not None:
        attributes["sink"] = sink
    return type(f"HiCacheMachine_{slug}{'_' + key if key else ''}", (HiCacheMachine,), attributes)
