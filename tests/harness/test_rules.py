"""A rule is defined once: the records of ``harness/rules/`` are what the trace format names,
what the session applies, what the machine draws and what the campaign counts."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from hicache_ref.campaign.report import RULE_FAMILIES
from hicache_ref.campaign.run import run_campaign
from hicache_ref.distributed.schedule import schedule_entries
from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.campaigns.machine import MACHINE_RULES
from hicache_ref.harness.rules import RULES, rule_families
from hicache_ref.harness.step_types import RuleName
from hicache_ref.harness.steps.programs import LOAD_PATH_SHARE_MIN, PROGRAMS
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

LOAD_PATH_CAMPAIGN_SECONDS = 15


def test_trace_rule_names_are_exactly_the_records() -> None:
    # RuleName (the stable trace format) <-> one record per atomic rule
    assert sorted(get_args(RuleName)) == sorted(RULES)
    assert all(name == record.name for name, record in RULES.items())


def test_records_pair_a_rule_with_its_process_as_the_oracle_does() -> None:
    # _rule_<name> says when (and why not), process_<name> what; shared helpers may serve many
    for name, record in RULES.items():
        process = record.process.__name__
        assert process in (f"process_{name}", "<lambda>"), (name, process)
        assert record.doc and record.family


def test_campaign_families_agree_with_the_records() -> None:
    # every rule the campaign report names sits in the family its record gives it
    families = rule_families()
    for family, names in RULE_FAMILIES.items():
        for name in names:
            assert name in families[family], f"{name}: campaign says {family!r}"


def test_every_drawn_record_is_a_generated_machine_rule() -> None:
    # a record whose draw is in_machine -> a machine rule of its name, drawn with its params
    drawn = {rule.name: rule for rule in MACHINE_RULES}
    for name, record in RULES.items():
        if record.draw is None or not record.draw.in_machine:
            assert name not in drawn, f"{name} is drawn only by compounds, yet has a machine rule"
            continue
        assert name in drawn, f"{name} has a draw but no machine rule"
        assert [key for key, _ in drawn[name].params] == list(record.draw.params)
        assert drawn[name].offered is record.draw.offered


def test_every_program_is_a_machine_rule_or_a_weighted_entry() -> None:
    # a compound program -> a machine rule of its name (in_machine), or drawn by the CP
    # processes' schedule (weight); its name never hides an atomic rule
    for name, program in PROGRAMS.items():
        assert name not in RULES, f"program {name} shadows the atomic rule of that name"
        assert program.in_machine or program.weight, f"program {name} is drawn by nothing"
        assert (name in {rule.name for rule in MACHINE_RULES}) == program.in_machine, name


def test_the_cp_process_schedule_draws_from_the_records_and_programs() -> None:
    # weights live in the records and programs; every weighted record has a draw to sample
    entries = schedule_entries()
    names = {entry.name for entry in entries}
    assert {r.name for r in RULES.values() if r.weight} <= names
    assert {p.name for p in PROGRAMS.values() if p.weight} <= names
    assert all(RULES[n].draw is not None for n in names if n in RULES)
    assert not any(RULES[n].probe for e in schedule_entries(probes=False) if (n := e.name) in RULES)


def test_a_skipped_step_keeps_its_records_reason() -> None:
    # evict_host of a node that does not exist -> skipped, and the replay says why
    session = Session(HarnessConfig(), ReferenceImplementation(), "reference")
    assert session.apply(Step(rule="evict_host", args={"node": 42})).skipped
    assert session.why_disabled(Step(rule="evict_host", args={"node": 42})) == (
        "node 42 is not host only and not loading"
    )
    steps = (Step(rule="advance", args={"stream": "write", "n": 0}), Step(rule="noop"))
    result = replay(Trace(header=TraceHeader(config=HarnessConfig()), steps=steps))
    assert result.outcomes == ("skipped", "noop")
    assert result.render_skips(steps) == [
        "step 0: advance(stream='write', n=0) skipped: advance needs a stream in "
        "('forward', 'write', 'load') and n >= 1"
    ]


def test_the_load_path_keeps_a_fifth_of_the_applied_steps(tmp_path: Path) -> None:
    # a short campaign on the reference -> load, start_loading, reads, drains >= 20% of steps
    report = run_campaign(
        "reference",
        seconds=LOAD_PATH_CAMPAIGN_SECONDS,
        profile="ci",
        seed=0,
        out_dir=tmp_path,
        progress=False,
    )
    load_path = set(rule_families()["load path"])
    # the L3 families are their own budget: under schedule points a storage loop body is 3-5
    # cheap steps, which would crowd the share of a time-bounded campaign
    l3 = set(rule_families()["storage"]) | set(rule_families()["schedule"])
    applied = sum(n for rule, n in report.rules.items() if rule not in l3)
    share = sum(n for rule, n in report.rules.items() if rule in load_path) / applied
    assert not report.failures
    assert share >= LOAD_PATH_SHARE_MIN, dict(report.rules)
