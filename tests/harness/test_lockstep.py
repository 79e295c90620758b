"""The oracle in lockstep (harness/lockstep/oracle.py): it follows the reference step by step, catches
seeded mutants the ordinary checks catch later (INV-12) or not at all (INV-07), and names the quantity when it diverges:
ack rows and lifecycles INV-16, producer slots INV-10, pages INV-05, content INV-06, a refusal
INV-17.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.campaigns.machine import SWARM, MachineRule, _draw_config, machine_for
from hicache_ref.harness.campaigns.profiles import lockstep_enabled, make_settings
from hicache_ref.harness.lockstep import oracle as lockstep_module
from hicache_ref.harness.lockstep.compare import compare_final_content, compare_state
from hicache_ref.harness.lockstep.oracle import LockstepOracle, attach_lockstep
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.rules.record import untranslated
from hicache_ref.harness.step_types import StepArg, done, refused
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.oracle.geometry import compute_token_tag
from hicache_ref.oracle.state import Ack, evolve, replace_at, with_fault, with_node

CONFIG = HarnessConfig(page_size=2, layer_num=2, device_pages=12, host_pages=16, seed=3)
DRAFT = CONFIG.model_copy(update={"draft_layer_num": 1})


@pytest.fixture(autouse=True)
def _lockstep_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")  # whatever HICACHE_PROFILE says


def step(rule: str, **args: StepArg) -> Step:
    return Step(rule=rule, args=args)  # type: ignore[arg-type]


def stored_node(handle: int = 0, tokens: int = 4, layers: int = 2) -> list[Step]:
    """A prefill whose forward queues every layer's store (not yet run)."""
    prefill = step("prefill", tokens=tokens, early_reserve=False, handle=handle, batch=True)
    return [prefill] + [step("forward_layer")] * layers


ROUND_TRIP = [
    *stored_node(),
    step("write", node=0),
    step("synchronize", stream="write"),
    step("drain_acks"),
    step("evict_device", node=0),
    step("load", node=0),
    step("start_loading"),
    step("forward_read", node=0, layer=1, draft=False),
    step("advance", stream="load", n=2),
    step("synchronize", stream="forward"),
    step("drain_acks"),
]


def followed(
    steps: Sequence[Step], config: HarnessConfig = CONFIG, impl: Implementation | None = None
) -> tuple[Session, LockstepOracle]:
    session = Session(config, impl or ReferenceImplementation(), "reference")
    oracle = attach_lockstep(session)
    assert oracle is not None and oracle.off_reason is None
    for s in steps:
        assert session.apply(s).text != "skipped", s
    return session, oracle


# -- the reference, followed ----------------------------------------------------------------------


def test_a_round_trip_is_followed_step_by_step_and_at_quiescence() -> None:
    session, oracle = followed(ROUND_TRIP, DRAFT)
    session.finish()
    assert oracle.steps == len(ROUND_TRIP)
    assert oracle.state.nodes[0].lifecycle == "loaded"


def test_a_world_without_the_simulators_log_is_turned_off_with_its_reason() -> None:
    session = Session(CONFIG, ReferenceImplementation(), "reference")
    session.world.device = object()  # type: ignore[assignment]  # e.g. a GPU campaign's device
    oracle = attach_lockstep(session)
    assert oracle is not None and oracle.off_reason is not None
    assert oracle.off_reason.startswith("not a SimDevice")
    assert session.stats.lockstep["cases_off"] == 1
    # still observed, doing nothing, so a campaign report counts the case under its reason
    assert oracle in session.observers and oracle.steps == 0
    assert session.stats.lockstep[f"off: {oracle.off_reason}"] == 1


def test_a_hybrid_world_is_followed() -> None:
    session, oracle = followed(ROUND_TRIP, CONFIG.model_copy(update={"hybrid": True}))
    session.finish()
    assert oracle.steps == len(ROUND_TRIP) and oracle.off_reason is None


def test_a_cp_round_trip_with_early_reservations_is_followed() -> None:
    # CP over 3 ranks: a prefill reserves early, the layer hooks back it up, a zero-owned rank
    # acks too; it goes to host and comes back with its owners replayed
    config = DRAFT.model_copy(update={"cp_size": 3, "pool_kind": "nsa", "draft_host_pages": 8})
    prefill = step("prefill", tokens=5, early_reserve=True, handle=0, batch=True)
    steps = [prefill, *ROUND_TRIP[1:3], *ROUND_TRIP[4:]]  # no write: the hooks back it up
    session, oracle = followed(steps, config)
    session.finish()
    assert oracle.steps == len(steps) and oracle.off_reason is None


def test_a_rule_without_an_oracle_translation_turns_lockstep_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a record whose translation was never written (the default) -> lockstep off, reason named
    session, oracle = followed(stored_node())
    untranslated_noop = dataclasses.replace(RULES["noop"], oracle=untranslated)
    monkeypatch.setattr(lockstep_module, "RULES", {**RULES, "noop": untranslated_noop})
    oracle.after_step(session, Step(rule="noop"), done("noop"))
    assert oracle.off_reason == "the oracle cannot express noop: the rule has no oracle translation"


def test_the_universe_grows_and_restarts_with_the_tree() -> None:
    # node ids 0, 1 -> reset -> node id 0 again, with another size
    steps = [*stored_node(0, 4), *stored_node(1, 6), step("reset"), *stored_node(2, 10)]
    session, oracle = followed(steps)
    assert oracle.state.config.node_tokens == (10, 6)
    assert oracle.state.nodes[0].lifecycle == "device_only"
    session.finish()


class _LockstepMachine(machine_for(ReferenceImplementation(), "reference")):  # type: ignore[misc]
    """The ci machine with the oracle in lockstep (what ``attach_lockstep`` in setup gives)."""

    @initialize(config=st.data(), swarm=SWARM)
    def setup(self, config: st.DataObject, swarm: tuple[MachineRule, ...]) -> None:
        drawn = _draw_config(self.implementation, config)
        self.swarm = swarm
        self.session = Session(drawn, self.implementation, self.impl_name)
        attach_lockstep(self.session)
        _FOLLOWED.append(self.session)


_FOLLOWED: list[Session] = []


def test_the_reference_passes_the_machine_in_lockstep() -> None:
    _FOLLOWED.clear()
    _LockstepMachine.TestCase.settings = make_settings("ci", max_examples=40)
    started = time.monotonic()
    _LockstepMachine.TestCase("runTest").runTest()
    assert time.monotonic() - started < 60
    stepped = sum(s.stats.lockstep["steps_in_lockstep"] for s in _FOLLOWED)
    followed_cases = sum(s.stats.lockstep["cases_in_lockstep"] for s in _FOLLOWED)
    assert stepped > 200 and followed_cases > 5


# -- seeded mutants: lockstep diverges first ------------------------------------------------------


def first_failure(
    steps: Sequence[Step], impl: Implementation, lockstep: bool, config: HarnessConfig = CONFIG
) -> tuple[int, str]:
    """(index of the failing step or len(steps) for finish, message); (-1, "") if none fails."""
    session = Session(config, impl, "mutant")
    if lockstep:
        attach_lockstep(session)
    for index, s in enumerate(steps):
        try:
            session.apply(s)
        except InvariantViolation as violation:
            return index, str(violation)
    try:
        session.finish()
    except InvariantViolation as violation:
        return len(steps), str(violation)
    return -1, ""


def test_an_unfenced_d2h_diverges_when_it_runs_not_when_its_ack_drains() -> None:
    # write -> the D2H runs before the forward ran the stores -> lockstep: INV-12 at once;
    # the ordinary checks see stale host bytes only when the ack drains, two steps later
    steps = [
        *stored_node(),
        step("write", node=0),
        step("advance", stream="write", n=3),
        step("synchronize", stream="forward"),
        step("drain_acks"),
    ]
    impl = get_implementation("mutant:skip_write_fence")
    at, message = first_failure(steps, impl, lockstep=True)
    assert at == 4 and message.startswith("INV-12 violated: lockstep at step 4 (advance")
    plain_at, plain = first_failure(steps, get_implementation("mutant:skip_write_fence"), False)
    assert plain_at == 6 and plain.startswith("INV-09")


def test_an_off_by_one_producer_slot_diverges_at_start_loading() -> None:
    # load -> start_loading hands the scheduler the slot before the one it loaded into: the
    # oracle's slot differs at once (INV-10); the ordinary checks need a read that runs early
    steps = [*ROUND_TRIP[:9], step("advance", stream="load", n=9)]
    at, message = first_failure(steps, get_implementation("mutant:wrong_consumer_slot"), True)
    assert at == 8 and message.startswith("INV-10 violated: lockstep divergence at step 8")
    assert "producer slot of node 0: oracle 0, implementation 4" in message
    plain = first_failure(steps, get_implementation("mutant:wrong_consumer_slot"), False)
    assert plain == (-1, "")


def test_a_merged_load_ack_without_every_node_diverges_at_start_loading() -> None:
    # two nodes loaded back by one start_loading: the ack names one of them; the oracle's row
    # names both (INV-16); the ordinary checks see it when the acks never drain at quiescence
    steps = [*stored_node(0), *stored_node(1)[:1], *[step("forward_layer")] * 2]
    for node in (0, 1):
        steps += [step("write", node=node), step("synchronize", stream="write")]
        steps += [step("drain_acks"), step("evict_device", node=node)]
    steps += [step("load", node=0), step("load", node=1), step("start_loading")]
    impl = get_implementation("mutant:merged_load_ack_drops_node_ids")
    at, message = first_failure(steps, impl, True)
    assert at == len(steps) - 1 and message.startswith("INV-16 violated: lockstep divergence")
    assert "ack_load_queue rows of rank 0: oracle ((0, 1),), implementation ((0,),)" in message
    plain_at, plain = first_failure(
        steps, get_implementation("mutant:merged_load_ack_drops_node_ids"), False
    )
    assert plain_at == len(steps) and "acks never drained" in plain


def test_a_cancel_that_does_not_drain_the_write_stream_is_caught_only_in_lockstep() -> None:
    # CP early reservation -> layer 0's D2H queued by its hook -> cancel returns without
    # synchronizing -> the rollback frees host slots the D2H still writes: INV-07 at the cancel.
    # The ordinary checks never see it (every later user of the slots is ordered after the copy)
    config = CONFIG.model_copy(update={"cp_size": 2, "pool_kind": "nsa"})
    prefill = step("prefill", tokens=4, early_reserve=True, handle=0, batch=True)
    steps = [prefill, step("forward_layer"), step("cancel", node=0)]
    steps += [step("advance", stream="write", n=5), step("forward_layer")]
    results = []
    for lockstep in (True, False):
        impl = get_implementation("mutant:cancel_without_write_sync")
        results.append(first_failure(steps, impl, lockstep, config))
    (at, message), plain = results
    assert at == 2 and message.startswith("INV-07 violated: lockstep at step 2 (cancel")
    assert "freed while a queued copy still uses them" in message
    assert plain == (-1, "")


# -- a divergence names its quantity (bad oracle states) ------------------------------------------


@pytest.fixture
def mid_backup() -> tuple[Session, LockstepOracle]:
    """Node 0 backed up and evicted, node 1 loading back, node 2 mid backup (draft pool too)."""
    steps = [
        *stored_node(0),
        step("write", node=0),
        step("synchronize", stream="write"),
        step("drain_acks"),
        step("evict_device", node=0),
        step("load", node=0),
        step("start_loading"),
        *stored_node(1),
        step("write", node=1),
    ]
    return followed(steps, DRAFT)


def diverges(session: Session, state: object, inv_id: str, quantity: str) -> None:
    with pytest.raises(InvariantViolation, match=quantity) as caught:
        compare_state(session, state, "the test")  # type: ignore[arg-type]
    assert caught.value.inv_id == inv_id
    assert "lockstep divergence at the test" in str(caught.value)


def test_a_missing_write_ack_row_is_a_divergence(
    mid_backup: tuple[Session, LockstepOracle],
) -> None:
    session, oracle = mid_backup
    state = evolve(oracle.state, write_acks=((),))
    diverges(
        session,
        state,
        "INV-16",
        r"ack_write_queue rows of rank 0: oracle \(\), implementation \(\(1,\),\)",
    )


def test_load_ack_rows_in_another_order_are_a_divergence(
    mid_backup: tuple[Session, LockstepOracle],
) -> None:
    session, oracle = mid_backup
    extra = Ack((5,), None, 1)
    state = evolve(oracle.state, load_acks=((extra, *oracle.state.load_acks[0]),))
    diverges(session, state, "INV-16", "ack_load_queue rows of rank 0")


def test_a_wrong_lifecycle_is_a_divergence(mid_backup: tuple[Session, LockstepOracle]) -> None:
    session, oracle = mid_backup
    record = evolve(oracle.state.nodes[1], lifecycle="backed_up")
    diverges(
        session,
        with_node(oracle.state, 1, record),
        "INV-16",
        "lifecycle of node 1: oracle backed_up",
    )


def test_a_wrong_producer_slot_is_a_divergence(mid_backup: tuple[Session, LockstepOracle]) -> None:
    session, oracle = mid_backup
    record = evolve(oracle.state.nodes[0], load_slot=3)
    diverges(
        session, with_node(oracle.state, 0, record), "INV-10", "producer slot of node 0: oracle 3"
    )


def test_a_node_only_the_oracle_holds_is_a_divergence(
    mid_backup: tuple[Session, LockstepOracle],
) -> None:
    session, oracle = mid_backup
    state = evolve(oracle.state, nodes=(*oracle.state.nodes, oracle.state.nodes[1]))
    diverges(
        session, state, "INV-16", "lifecycle of node 2: oracle backup_in_flight, implementation not"
    )


def test_other_device_pages_are_a_divergence(mid_backup: tuple[Session, LockstepOracle]) -> None:
    session, oracle = mid_backup
    record = evolve(oracle.state.nodes[1], device_pages=(11, 12))
    diverges(
        session, with_node(oracle.state, 1, record), "INV-05", "device pages of node 1: oracle"
    )


def test_other_host_pages_are_a_divergence(mid_backup: tuple[Session, LockstepOracle]) -> None:
    session, oracle = mid_backup
    record = evolve(oracle.state.nodes[0], host_pages=((14, 15),))
    diverges(
        session,
        with_node(oracle.state, 0, record),
        "INV-05",
        r"host pages of node 0: oracle \[\[14",
    )


def test_other_draft_host_pages_are_a_divergence(
    mid_backup: tuple[Session, LockstepOracle],
) -> None:
    session, oracle = mid_backup
    record = evolve(oracle.state.nodes[0], draft_host_pages=((14, 15),))
    diverges(session, with_node(oracle.state, 0, record), "INV-05", "draft host pages of node 0")


def test_the_oracles_own_verdict_fails_the_step(mid_backup: tuple[Session, LockstepOracle]) -> None:
    _, oracle = mid_backup
    oracle.state = with_fault(oracle.state, "INV-07", "a planted fault")
    with pytest.raises(InvariantViolation, match=r"lockstep at the test: .* a planted fault"):
        oracle._compare("the test")


def test_a_tag_the_bytes_do_not_hold_is_a_divergence(
    mid_backup: tuple[Session, LockstepOracle],
) -> None:
    session, oracle = mid_backup
    session.world.device.run_until_idle()
    state = oracle.state
    page = state.nodes[1].device_pages[0]
    wrong = compute_token_tag(0, 1, state.config.token_stride)  # node 0's token 1, not node 1's 0
    channel = replace_at(state.device_tags[0], page * 2, wrong)
    state = evolve(state, device_tags=replace_at(state.device_tags, 0, channel))
    with pytest.raises(
        InvariantViolation, match=f"content of target layer 0 device slot {page * 2}"
    ) as caught:
        compare_final_content(session, state, oracle.handles, "the test")
    assert caught.value.inv_id == "INV-06"


def test_a_write_refused_while_the_oracle_has_room_is_a_divergence() -> None:
    session, oracle = followed(stored_node())
    with pytest.raises(
        InvariantViolation, match="refused \\(host capacity\\), but the oracle"
    ) as caught:
        oracle.after_step(session, step("write", node=0), refused("host full"))
    assert caught.value.inv_id == "INV-17"


def test_the_profiles_say_when_lockstep_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_LOCKSTEP", raising=False)
    assert lockstep_enabled("ci") and lockstep_enabled("dev") and not lockstep_enabled("campaign")
    monkeypatch.setenv("HICACHE_LOCKSTEP", "0")
    assert not lockstep_enabled("ci")
    assert attach_lockstep(Session(CONFIG, ReferenceImplementation(), "reference")) is None
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")
    assert lockstep_enabled("campaign")
