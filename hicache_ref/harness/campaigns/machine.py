"""The Hypothesis state machine: rules named after protocol verbs, all applied through a Session.

Each case draws a configuration the implementation supports and a swarm (``Swarm``: the rules this
case may draw, or every rule), then a program of rules. The machine's rules (``MACHINE_RULES``) are
one per compound program (``programs.PROGRAMS`` with ``in_machine``: new_request, compute, offload,
reload, reload_staggered, round_trip, cancel_and_reuse, scheduler_check, storage_round_trip,
storage_steps) and one per atomic rule record whose draw is ``in_machine`` (``rules.RULES``), named
after it: its precondition is its ``offered`` and its arguments are its params (each drawn as its
strategy would). Hypothesis sees a single rule, ``step``, whose argument (``RuleChoices``) draws one
of them, uniformly among those the swarm keeps and the session offers, then its arguments; the steps
it yields are applied one by one, and the session checks each against its record. Rules pick nodes
among the candidates the session offers (the ``offered`` draw keeps impossible rules out; no
``assume``), and mirror nothing in bundles: the session holds the state, so preconditions can see
it. After every step the session checks its invariants; teardown runs the quiescence checks. When a
case fails, the machine hands its trace to the class's ``sink``, and notes the line that replays it.

Nothing is shared through module globals: ``machine_for(implementation, name, sink)`` binds the
implementation and a ``CaseSink`` (a campaign's: it counts every finished case and keeps the
failing traces where that campaign wants them) to a fresh machine class. Without one, failing
traces go to ``fuzz/out/`` (``FailureFolder``), as for the machines pytest runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast

from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from hicache_ref.harness.adapters.base import (
    HOST_PRESSURE_CAPABILITY,
    LOCK_POINTS_CAPABILITY,
    Implementation,
    supports,
)
from hicache_ref.harness.campaigns.side_draws import (
    buffer_world,
    side_pool_fields,
    storage_sidecar_fields,
    stored_side_pool_fields,
)
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.rules.record import Param, draw_small_int, integers_once
from hicache_ref.harness.steps.programs import PROGRAMS, atomic_steps
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import (
    LEGAL_LAYOUTS,
    MHA_ONLY_LAYOUTS,
    AllocPolicy,
    CopyPath,
    HarnessConfig,
    IoBackend,
    Layout,
    PoolGroup,
    PoolKind,
)
from hicache_ref.harness.world.storage_config import storage_fields
from hicache_ref.harness.world.world import SIM_WORLDS, DeviceWorlds
from hicache_ref.pools.transfer import copy_paths_for_layout
from hicache_ref.replay_lines import get_replay_line

DEFAULT_FAILURE_DIR = Path("fuzz/out")
DRAWN_COPY_PATHS: tuple[CopyPath, ...] = ("gather", "runs", "batch")
"""Copy paths a case draws: the simulator's gather, and the two GPU paths (run-merged copies,
the copy engine's batched page copies, executed on the CPU by ``memmove`` from the same pointer
plan). ``triton`` is left to the transfer tests: its CPU interpreter is too slow per step."""


class CaseSink(Protocol):
    """What a machine hands the campaign that runs it."""

    def on_case(self, session: Session) -> None:
        """A case finished without failing (its stats feed the campaign's report)."""

    def on_failure(self, trace: Trace, schedule: dict[str, Any] | None = None) -> Path:
        """A case failed: keep its trace and say where (Hypothesis may re-run it many times);
        ``schedule``: its PCT bias (``schedule/pct.py``), under the ``campaign`` profile."""

    def on_known(self, exc: BaseException) -> bool:
        """Whether the failure is a written-up finding (then counted, and the case rejected)."""


@dataclass
class FailureFolder:
    """The sink of a machine no campaign runs: ``folder/failure-<impl>.jsonl``, rewritten by
    each failing run (Hypothesis shows the note of the final, shrunk run only)."""

    folder: Path = DEFAULT_FAILURE_DIR
    last_failure: Path | None = field(default=None, compare=False)

    def on_case(self, session: Session) -> None:
        return None

    def on_failure(self, trace: Trace, schedule: dict[str, Any] | None = None) -> Path:
        name = trace.header.implementation.replace(":", "-")
        self.last_failure = trace.write(self.folder / f"failure-{name}.jsonl")
        return self.last_failure

    def on_known(self, exc: BaseException) -> bool:
        return False  # a plain pytest run knows no findings: every failure fails


# the strategies a case's configuration draws from, built once (not once per case)
_PAGE_SIZES = st.sampled_from([1, 2, 4, 16])
_IO_BACKENDS: st.SearchStrategy[IoBackend] = st.sampled_from(["direct", "kernel"])
_LAYOUTS: dict[str, st.SearchStrategy[Layout]] = {
    io: st.sampled_from(cast("tuple[Layout, ...]", layouts))
    for io, layouts in LEGAL_LAYOUTS.items()
}
_LAYOUT_NAMES = [cast("tuple[Layout, ...]", layouts) for layouts in LEGAL_LAYOUTS.values()]
_CP_SIZES = st.sampled_from([0, 0, 1, 2, 3, 4])
_POOL_KINDS: st.SearchStrategy[PoolKind] = st.sampled_from(["mha", "mla", "nsa"])
_POLICIES: st.SearchStrategy[AllocPolicy] = st.sampled_from(["fifo", "lifo", "random"])
_COUNTERS = st.sampled_from([2, 5])
_HYBRID = st.sampled_from([False, False, True])
_BOOLS = st.booleans()
_PRESSURE = st.sampled_from([False, False, False, True])
"""A quarter of the storage worlds cut a hit to the host room (the storage oracle follows the
others: it serves hits whole)."""


@functools.cache
def _sampled(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(values)``, built once per tuple of values."""
    return st.sampled_from(values)


_COPY_PATHS: dict[Layout, st.SearchStrategy[CopyPath]] = {
    layout: st.sampled_from([p for p in DRAWN_COPY_PATHS if p in copy_paths_for_layout(layout)])
    for layouts in _LAYOUT_NAMES
    for layout in layouts
}


@st.composite
def harness_configs(draw: st.DrawFn, capabilities: frozenset[str] = frozenset()) -> HarnessConfig:
    """Configurations drawn per case, restricted to what the implementation supports."""
    page_size = draw(_PAGE_SIZES)
    io_backend: IoBackend = draw(_IO_BACKENDS)
    layout: Layout = draw(_LAYOUTS[io_backend])
    mha_only = layout in MHA_ONLY_LAYOUTS
    storage = draw(_storage_fields(capabilities))  # a storage world has no CP and no draft
    cp_size = 0 if mha_only or storage else draw(_CP_SIZES)
    pool_kind: PoolKind = "mha" if mha_only else "nsa" if cp_size else draw(_POOL_KINDS)
    layer_num = draw(integers_once(1, 3))
    draft_layer_num = 0 if storage else draw(_sampled((0, 0, layer_num - 1, layer_num + 1)))
    ranks = max(1, cp_size)
    fields: dict[str, Any] = {
        "page_size": page_size,
        "layer_num": layer_num,
        "draft_layer_num": max(0, draft_layer_num),
        "pool_kind": pool_kind,
        "layout": layout,
        "io_backend": io_backend,
        "cp_size": cp_size,
        "device_pages": draw(integers_once(2 * ranks + 6, 2 * ranks + 40)),
        "host_pages": draw(integers_once(2, 24)),
        "alloc_policy": draw(_POLICIES),
        "draft_alloc_policy": draw(_POLICIES),
        "draft_host_pages": draw(integers_once(1, 24)) if cp_size and draft_layer_num > 0 else 0,
        "num_counters": draw(_COUNTERS),
        "settle_records": draw(_BOOLS),
        "copy_path": draw(_COPY_PATHS[layout]),  # the copy engine's batch refuses some layouts
        "hybrid": draw(_HYBRID),
        "seed": draw(integers_once(0, 2**16)),
        **storage,
    }
    # Fields added later come after every other draw, so the programs of pinned campaigns keep
    # their configurations: the forward's stream follows the seed's low bit (no draw at all),
    # and a pool group is drawn only where there is a choice (upstream 0.5.19+).
    groups = _pool_groups(capabilities, cp_size, max(0, draft_layer_num))
    fields["forward_stream"] = not cp_size and _fenced(capabilities) and bool(fields["seed"] & 1)
    fields["pool_group"] = draw(_sampled(tuple(groups))) if len(groups) > 1 else groups[0]
    fields.update(side_pool_fields(draw, capabilities, fields))
    if fields.get("storage_points") and _asks_lock_points(capabilities):
        fields["storage_lock_points"] = draw(_BOOLS)
    fields.update(storage_sidecar_fields(draw, capabilities, fields))
    if fields.get("storage_ranks") and HOST_PRESSURE_CAPABILITY in capabilities:
        # an SWA window's storage worlds cut hits to the host room (a quarter elsewhere): the
        # cut is what _sync_trailing_keys re-aligns the window to
        pressure = draw(_PRESSURE)
        fields["storage_host_pressure"] = pressure or bool(fields.get("storage_swa_window"))
    fields.update(stored_side_pool_fields(draw, capabilities, fields))
    if buffer_world(capabilities, fields):
        fields["storage_buffer_only"] = True
    config = HarnessConfig(**fields)  # validated once, with every field
    if capabilities and not supports(capabilities, config):
        return draw(st.nothing())
    return config


def _asks_lock_points(capabilities: frozenset[str]) -> bool:
    """Whether the tier parks at its operation locks only when a world asks
    (``storage:lock_points``, this project's tier): then half the worlds with schedule points
    ask, drawn after every other field so no other world's draws move. Upstream's threads park
    there in every world with points, and draw nothing more."""
    return not capabilities or LOCK_POINTS_CAPABILITY in capabilities


def _fenced(capabilities: frozenset[str]) -> bool:
    """Whether the forward may run on its own stream (``fence_streams``; no restriction given)."""
    return not capabilities or "fence_streams" in capabilities


def _pool_groups(capabilities: frozenset[str], cp_size: int, draft_layers: int) -> list[PoolGroup]:
    """The ways the host pools may reach the controller (``pool_group``; upstream 0.5.19+)."""
    if cp_size or "pool_group" not in capabilities:
        return ["none"]
    if draft_layers <= 0:
        return ["none", "anchor"]
    grouped: list[PoolGroup] = ["packed", "sidecar"]
    return ["none", *(g for g in grouped if f"pool_group:{g}" in capabilities)]


@functools.cache
def _storage_fields(capabilities: frozenset[str]) -> st.SearchStrategy[dict[str, Any]]:
    return storage_fields(capabilities)


@functools.cache
def _configs(capabilities: frozenset[str]) -> st.SearchStrategy[HarnessConfig]:
    """The configurations of one capability set, built once per set (not once per case)."""
    return harness_configs(capabilities)


def _draw_config(implementation: Implementation, data: st.DataObject) -> HarnessConfig:
    config = data.draw(_configs(frozenset(implementation.capabilities)))
    refined = implementation.refine_config(config)  # contract: optional hook
    if refined is config:
        return config
    # a refinement is a model_copy, which skips validation: validate the world it asks for
    try:
        refined = HarnessConfig.model_validate(refined.model_dump())
    except ValueError:
        reject()  # e.g. a focus that turns on CP for an MHA-only layout: draw another
    if not supports(implementation.capabilities, refined):
        reject()
    return refined


@dataclass(frozen=True)
class MachineRule:
    """One rule the machine may draw: a compound program or an atomic record's draw."""

    name: str
    offered: Callable[[Session], bool]
    params: tuple[tuple[str, Param], ...]
    steps: Callable[[Session, Mapping[str, Any]], Iterator[Step]]

    def __repr__(self) -> str:
        return self.name

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis' printed program
        printer.text(repr(self))


@dataclass(frozen=True)
class Choice:
    """A drawn rule and its drawn arguments (shown as ``name(arg=value, ...)``)."""

    rule: MachineRule
    drawn: Mapping[str, Any]

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.drawn.items())
        return f"{self.rule.name}({args})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis' printed program
        printer.text(repr(self))


class RuleChoices(st.SearchStrategy[Choice]):
    """Draws one rule among those the case's swarm keeps and its session offers (uniformly),
    then the rule's arguments. Like Hypothesis' own rule draw, it first tries a few rules of the
    swarm at random, and asks every rule only when none of those is offered. The machine draws
    its rules itself, through this one Hypothesis rule, rather than as one Hypothesis rule each:
    Hypothesis' filtered rule draw asked ~25 preconditions and drew a swarm flag per rule and
    step, a quarter of a case (``benchmarks/RESULTS.md``)."""

    def do_draw(self, data: Any) -> Choice:
        machine = cast("HiCacheMachine", data.draw(_RUNNER))
        session = machine.s
        swarm = machine.swarm
        chosen: MachineRule | None = None
        refused: set[int] = set()  # indices the tries found not offered (the state is the same)
        for _ in range(RULE_TRIES):
            index = draw_small_int(data, 0, len(swarm) - 1)
            if index not in refused and swarm[index].offered(session):
                chosen = swarm[index]
                break
            refused.add(index)
        if chosen is None:
            offered = [
                r for i, r in enumerate(swarm) if i not in refused and r.offered(session)
            ] or list(_ALWAYS)
            chosen = offered[draw_small_int(data, 0, len(offered) - 1)]
        # each index and argument is one choice, as its strategy would draw it, without a span
        # of its own (``rules/record.draw_small_int``): the step's draw is the span
        return Choice(chosen, {key: param.draw(data) for key, param in chosen.params})


def _machine_rules() -> tuple[MachineRule, ...]:
    rules = [
        MachineRule(p.name, p.offered, tuple(p.params.items()), p.run)
        for p in PROGRAMS.values()
        if p.in_machine
    ]
    for record in RULES.values():
        if record.draw is not None and record.draw.in_machine:
            # Verify a generated atomic rule does not hide a compound rule of the same name
            assert all(r.name != record.name for r in rules), f"{record.name}: compound or atomic?"
            draw = record.draw
            rules.append(
                MachineRule(
                    record.name, draw.offered, tuple(draw.params.items()), atomic_steps(record)
                )
            )
    return tuple(sorted(rules, key=lambda r: (len(r.params), r.name)))


MACHINE_RULES = _machine_rules()
"""Every rule the machine draws, by name (the swarm mask and the choice index follow this order)."""
ALWAYS_OFFERED = frozenset({"new_request", "round_trip"})
_SWARM_ON = st.booleans()
_SWARM_MASK = st.integers(0, (1 << len(MACHINE_RULES)) - 1)
RULE_TRIES = 3
"""Rules tried at random before every rule is asked (Hypothesis' filtered draw tries as many)."""
_ALWAYS = tuple(r for r in MACHINE_RULES if r.name in ALWAYS_OFFERED)
_RUNNER = st.runner()
RULE_CHOICES = RuleChoices()


class Swarm(st.SearchStrategy[tuple[MachineRule, ...]]):
    """Swarm testing: the rules one case may draw. A case first draws whether it leaves any
    out, then one bit per rule (set: left out), in two draws that shrink towards every rule
    kept. One always-offered rule always stays, so a case never runs dry."""

    def do_draw(self, data: Any) -> tuple[MachineRule, ...]:
        if not data.draw(_SWARM_ON):
            return MACHINE_RULES
        left_out = data.draw(_SWARM_MASK)
        kept = tuple(r for i, r in enumerate(MACHINE_RULES) if not left_out >> i & 1)
        if not any(r.name in ALWAYS_OFFERED for r in kept):
            kept = (*kept, _ALWAYS[0])
        return kept


SWARM = Swarm()


class CampaignTimeUp(KeyboardInterrupt):
    """A case would start after its campaign's time is up: the round ends there, between two
    cases (never inside one), and the campaign with it (``campaign/rounds.py``, which tells it
    from Ctrl-C). Hypothesis takes it as it takes Ctrl-C: the case it cut is neither a failure
    nor a test case it records (any other exception would end the case in its tree of choices,
    and a later case drawing past that point would read as flaky data generation)."""


class HiCacheMachine(RuleBasedStateMachine):
    """Drives one implementation through write, load, cancel and evict interleavings."""

    implementation: Implementation
    impl_name = "reference"
    sink: ClassVar[CaseSink] = FailureFolder()
    build: ClassVar[DeviceWorlds] = SIM_WORLDS  # each case's world, on its device
    lockstep: ClassVar[bool | None] = None  # the campaign's profile decides; None: the env's
    pct: ClassVar[bool | None] = None  # PCT bias over the storage threads (profile campaign)
    time_up: ClassVar[Callable[[], bool] | None] = None
    """The campaign's clock: True once no further case may start (None: no time limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None
        self.failed = False
        self.reported: Path | None = None  # where this case's failing trace went, once handed
        self.swarm: tuple[MachineRule, ...] = ()

    @property
    def s(self) -> Session:
        assert self.session is not None, "initialize() draws the configuration first"
        return self.session

    def _apply(self, step: Step) -> None:
        try:
            self.s.apply(step)
        except Exception as exc:
            self.failed = True  # teardown must not replace this error with a consequence
            self._pass_known(exc)
            self.reported = self._report_failure(exc)
            raise
        except KeyboardInterrupt:
            self.failed = True  # Ctrl-C cut the step short: its half-done state proves nothing
            raise

    def _pass_known(self, exc: BaseException) -> None:
        """A written-up finding ends the case as invalid (counted by the sink), so the round
        goes on with its next case instead of shrinking it and starting over."""
        if self.sink.on_known(exc):
            reject()

    def _report_failure(self, exc: BaseException) -> Path | None:
        """Hand this case's trace to the sink, note the replay line, and say where it went.

        Hypothesis shrinks by re-running failing cases; the sink keeps the latest, and a note is
        shown only for the final (shrunk) run, so exactly one line is printed. A case reports
        once: a failure already handed (``reported``) is not handed again.
        """
        if self.session is None or self.reported is not None:
            return self.reported
        trace = self.s.trace(note=f"{type(exc).__name__}: {exc}"[:500])
        storage = self.s.storage
        bias = None if storage is None or storage.points is None else storage.points.bias
        path = self.sink.on_failure(trace, None if bias is None else bias.describe())
        note(
            f"hicache_ref: {len(trace.steps)}-step failure ({type(exc).__name__}); "
            f"replay with: {get_replay_line(path, self.impl_name)}"
        )
        return path

    @initialize(config=st.data(), swarm=SWARM)
    def setup(self, config: st.DataObject, swarm: tuple[MachineRule, ...]) -> None:
        time_up = type(self).time_up
        if time_up is not None and time_up():
            raise CampaignTimeUp
        drawn = _draw_config(self.implementation, config)
        self.session = Session(drawn, self.implementation, self.impl_name, build=self.build)
        attach_lockstep(self.session, self.lockstep)  # the pure oracle follows every step
        storage = self.session.storage
        if self.pct is not None and storage is not None and storage.points is not None:
            storage.points.use_pct(self.pct)  # the campaign profile's PCT bias
        self.swarm = swarm

    @rule(choice=RULE_CHOICES)
    def step(self, choice: Choice) -> None:
        """Apply the drawn rule's steps one by one (each sees the world the steps before it
        made)."""
        session = self.s
        session.candidates_current = True  # nothing ran since the draw asked for them
        try:
            for next_step in choice.rule.steps(session, choice.drawn):
                self._apply(next_step)
        finally:
            session.candidates_current = False

    def teardown(self) -> None:
        if self.session is None:
            return
        if self.failed:
            self.session.close()
            return
        try:
            self.session.finish()
        except Exception as exc:
            if self.sink.on_known(exc):
                return  # counted; Hypothesis has concluded the case, it cannot be rejected now
            self.reported = self._report_failure(exc)
            raise
        finally:
            self.sink.on_case(self.session)  # its steps ran, whether quiescence held or not
            self.session.close()


def machine_for(
    implementation: Implementation,
    name: str,
    sink: CaseSink | None = None,
    *,
    key: str = "",
    build: DeviceWorlds | None = None,
    lockstep: bool | None = None,
    pct: bool | None = None,
    time_up: Callable[[], bool] | None = None,
) -> type[HiCacheMachine]:
    """A machine class bound to one implementation and the sink of the campaign running it.

    The class name is Hypothesis' example-database key for its failures; ``key`` (a digest of
    the implementation's source, say) keeps two trees gated under one name apart there.
    ``time_up``: the campaign's clock; once it says so, no further case starts
    (``CampaignTimeUp``).
    """
    slug = name.replace(":", "_").replace("-", "_").replace(".", "_")
    attributes: dict[str, Any] = {"implementation": implementation, "impl_name": name}
    if sink is not None:
        attributes["sink"] = sink
    if build is not None:  # a GPU campaign's device (``world.open_device``)
        attributes["build"] = build
    if lockstep is not None:  # the campaign's profile decides (``profiles.lockstep_enabled``)
        attributes["lockstep"] = lockstep
    if pct is not None:  # the campaign's profile decides (``schedule/pct.py``)
        attributes["pct"] = pct
    if time_up is not None:
        attributes["time_up"] = staticmethod(time_up)
    return type(f"HiCacheMachine_{slug}{'_' + key if key else ''}", (HiCacheMachine,), attributes)
