"""Seeded programs, recorded on the reference: walks over the rule table and over the oracle.

``program_vector``: at each step, draw the arguments of every rule of ``rules.RULES`` (from
the record's ``draw`` through ``record.sample_params``, or its ``sample`` for a rule that has
none), then apply one of the enabled ones by its record's ``walk`` weight, or a compound
(``COMPOUNDS``: offload, reload, compute) as the machine's compound rules do; configurations
come from ``draw_config`` in flavors (``upstream``: what sglang runs). ``oracle_vector``: a
walk over the oracle's enabled ops, translated into harness steps (``harness/from_oracle``).

Nothing here uses Hypothesis' engine: every choice comes from ``random.Random`` seeded with the
suite seed and the program's index, so a program is the same on every machine and version.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import cast

from hicache_ref.harness.lockstep.from_oracle import harness_config_for, steps_for_ops
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.rules.evict import EVICT_DEVICE
from hicache_ref.harness.rules.forward import FORWARD_LAYER
from hicache_ref.harness.rules.load import DRAIN_ACKS, DRAIN_LOAD, FORWARD_READ, LOAD, START_LOADING
from hicache_ref.harness.rules.record import sample_params
from hicache_ref.harness.rules.streams import SYNCHRONIZE
from hicache_ref.harness.rules.write import WRITE
from hicache_ref.harness.steps.programs import PROGRAMS
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import (
    LEGAL_LAYOUTS,
    MHA_ONLY_LAYOUTS,
    CopyPath,
    HarnessConfig,
    Layout,
)
from hicache_ref.oracle import OracleConfig, Store, initial_state
from hicache_ref.oracle.step import OpNotEnabledError, all_ops, enabled_ops, step, why_disabled
from hicache_ref.pools.transfer import copy_paths_for_layout
from hicache_ref.vectors.models import Vector
from hicache_ref.vectors.record import Recorder

COPY_PATHS: tuple[CopyPath, ...] = ("gather", "runs", "batch")


# -- arguments ----------------------------------------------------------------------------------
class UnsampledRule(ValueError):
    """A rule a walk may pick (``RuleRecord.walk`` > 0) has neither a ``draw`` nor a
    ``sample``."""


def rule_step(recorder: Recorder, rule: str, rng: random.Random) -> Step | None:
    """A step of ``rule`` with arguments drawn for the session as it is now (None: none)."""
    session = recorder.session
    record = RULES[rule]
    if record.draw is not None:
        if not record.draw.offered(session):
            return None
        args = record.draw.choose(session, sample_params(record.draw.params, rng))
    elif record.sample is not None:
        args = record.sample(session, rng)
    elif not record.walk:
        return None  # oracle traces and stories apply it, never a walk
    else:
        raise UnsampledRule(
            f"rule {rule!r} has no draw and no sample: give its record a sample (or walk=0, "
            "if only oracle traces apply it) so generated vectors cover it"
        )
    return None if args is None else recorder.prepared(rule, args)


# -- configurations -----------------------------------------------------------------------------
FLAVORS = ("upstream", "upstream", "any", "cp", "draft", "storage", "storage")
STORAGE_BACKENDS = ("memory", "memory", "file")
"""The backends a storage vector draws: this project's own (upstream's ``HiCacheFile`` needs
its wheel tree, which a replayer of the suite may not have)."""


def draw_config(rng: random.Random, flavor: str) -> HarnessConfig:
    """A small world of one flavor: ``upstream`` (what sglang runs: no CP, no draft, three
    producer slots), ``cp``, ``draft``, ``storage`` (an L3 tier behind 1-4 TP ranks, no CP and
    no draft) or ``any``."""
    io = rng.choice(["direct", "kernel"])
    layout = cast("Layout", rng.choice(LEGAL_LAYOUTS[io]))
    cp = 0
    if flavor == "cp" and layout not in MHA_ONLY_LAYOUTS:
        cp = rng.choice([1, 2, 2, 3, 4])
    elif flavor == "any" and layout not in MHA_ONLY_LAYOUTS:
        cp = rng.choice([0, 0, 1, 2])
    pool = (
        "mha"
        if layout in MHA_ONLY_LAYOUTS
        else ("nsa" if cp else rng.choice(["mha", "mla", "nsa"]))
    )
    layers = rng.randint(1, 3)
    draft = 0
    if flavor in ("draft", "cp", "any") and rng.random() < (0.8 if flavor == "draft" else 0.4):
        draft = rng.choice([max(1, layers - 1), layers, layers + 1])
    ranks = max(1, cp)
    fields: dict[str, object] = dict(
        page_size=rng.choice([1, 2, 2, 4]),
        layer_num=layers,
        draft_layer_num=draft,
        pool_kind=pool,
        layout=layout,
        io_backend=io,
        cp_size=cp,
        device_pages=rng.randint(2 * ranks + 4, 2 * ranks + 14),
        host_pages=rng.randint(3, 12),
        alloc_policy=rng.choice(["fifo", "lifo", "random"]),
        draft_alloc_policy=rng.choice(["fifo", "lifo"]),
        draft_host_pages=rng.randint(2, 10) if cp and draft else 0,
        num_counters=3 if flavor == "upstream" else rng.choice([2, 5, 5]),
        settle_records=rng.random() < 0.5,
        hybrid=rng.random() < 0.15,
        copy_path=rng.choice([p for p in COPY_PATHS if p in copy_paths_for_layout(layout)]),
        seed=rng.randrange(1 << 16),
    )
    if flavor == "storage":
        fields.update(
            storage_ranks=rng.randint(1, 4),
            storage_backend=rng.choice(STORAGE_BACKENDS),
            storage_faults=rng.random() < 0.5,
            storage_batch_pages=rng.choice([1, 2, 4]),
            storage_policy=rng.choice(["best_effort", "wait_complete", "timeout"]),
            host_pages=rng.randint(6, 14),  # room for backups and a prefetch's bounce pages
        )
    return HarnessConfig.model_validate(fields)


# -- programs -----------------------------------------------------------------------------------
def _offload(recorder: Recorder, rng: random.Random) -> None:
    """Compound (as the machine's ``offload``): write, the write stream runs dry, drain,
    evict the device copy."""
    handles = recorder.session.candidates(WRITE.name)
    if not handles:
        return
    node = rng.choice(handles)
    for record, args in (
        (WRITE, {"node": node}),
        (SYNCHRONIZE, {"stream": "write"}),
        (DRAIN_ACKS, {}),
        (EVICT_DEVICE, {"node": node}),
    ):
        if not recorder.offer(recorder.prepared(record.name, args)):
            return


def _reload(recorder: Recorder, rng: random.Random) -> None:
    """Compound (as the machine's ``reload``): load one or two nodes, one start_loading, a
    forward read of the loading node, then maybe the load stream runs dry and drains."""
    handles = list(recorder.session.candidates(LOAD.name))
    rng.shuffle(handles)
    loaded = [
        h
        for h in handles[: rng.randint(1, 2)]
        if recorder.offer(recorder.prepared(LOAD.name, {"node": h}))
    ]
    if not loaded or not recorder.offer(recorder.prepared(START_LOADING.name)):
        return
    config = recorder.session.config
    read = {"node": loaded[0], "layer": rng.randrange(config.layer_num), "draft": False}
    recorder.offer(recorder.prepared(FORWARD_READ.name, read))
    if rng.random() < 0.7:
        recorder.offer(recorder.prepared(SYNCHRONIZE.name, {"stream": "load"}))
        recorder.offer(recorder.prepared(DRAIN_LOAD.name))


def _compute(recorder: Recorder, rng: random.Random) -> None:
    """Compound: the forward stores every remaining layer of its batch."""
    while recorder.session.tree.batch:
        if not recorder.offer(recorder.prepared(FORWARD_LAYER.name)):
            return


def _program(name: str) -> Callable[[Recorder, random.Random], None]:
    """Compound: one of the machine's programs (``harness/steps/programs.py``), its
    parameters drawn from ``rng``, each step it yields offered in turn (it stops at the first
    the session does not take)."""

    def run(recorder: Recorder, rng: random.Random) -> None:
        program = PROGRAMS[name]
        session = recorder.session
        if not program.offered(session):
            return
        for drawn in program.run(session, sample_params(program.params, rng)):
            if not recorder.offer(recorder.prepared(drawn.rule, drawn.args)):
                return

    return run


COMPOUNDS: Mapping[str, Callable[[Recorder, random.Random], None]] = {
    "offload": _offload,
    "reload": _reload,
    "compute": _compute,
    "storage_round_trip": _program("storage_round_trip"),
    "storage_steps": _program("storage_steps"),
}
"""Steps the walk may take several atomic steps at a time (each still one recorded step), so
programs of twenty-odd steps reach the load path as the machine's compound rules do."""
COMPOUND_CHANCE = 0.35
STORAGE_COMPOUNDS = frozenset({"storage_round_trip", "storage_steps"})
"""Drawn only in a storage world (elsewhere they have nothing to do)."""


def program_vector(
    seed: int,
    index: int,
    *,
    favour: str | None = None,
    length: int | None = None,
    settle: bool = True,
) -> Vector:
    """A seeded walk over the rule table, recorded on the reference (``favour``: a rule whose
    weight is raised, for coverage; ``settle=False``: drains read the reference's own partial
    progress, an ``ops`` vector)."""
    rng = random.Random(f"{seed}:{index}:{favour or ''}:{'' if settle else 'ops'}")
    flavor = FLAVORS[index % len(FLAVORS)]
    config = draw_config(rng, flavor)
    suffix = f"-{favour.replace('_', '-')}" if favour else ""
    prefix = "gen" if settle else "ops"
    recorder = Recorder(
        config,
        vector_id=f"{prefix}-{index:04d}{suffix}",
        title=f"seeded program {index} over the rule table ({flavor}: {config.describe()})",
        kind="generated",
        settle=settle,
    )
    target = length or rng.randint(10, 30) * (2 if config.uses_storage else 1)
    compounds = [n for n in sorted(COMPOUNDS) if config.uses_storage or n not in STORAGE_COMPOUNDS]
    for _ in range(4 * target):  # bounded: a walk with nothing left to do stops
        if len(recorder.steps) >= target:
            break
        if rng.random() < COMPOUND_CHANCE:
            COMPOUNDS[rng.choice(compounds)](recorder, rng)
            continue
        options = []
        for rule, record in RULES.items():
            if not record.walk:
                continue  # never drawn: its arguments are not sampled either (no RNG draw)
            candidate = rule_step(recorder, rule, rng)
            if candidate is not None and recorder.session.why_disabled(candidate) is None:
                weight = record.walk * (25.0 if rule == favour else 1.0)
                options.append((candidate, weight))
        if not options:
            break
        while options:
            chosen = rng.choices(range(len(options)), weights=[w for _, w in options])[0]
            if recorder.offer(options[chosen][0]):
                break
            options.pop(chosen)  # not determinate now: pick another
    return recorder.vector()


ORACLE_WEIGHTS: Mapping[str, float] = {
    "Reset": 0.05,
    "Store": 5.0,
    "Write": 4.0,
    "ReserveWriteCp": 3.0,
    "Load": 4.0,
    "StartLoading": 4.0,
    "DrainWriteAcks": 2.0,
    "DrainLoadAcks": 2.0,
    "EvictDevice": 2.0,
    "Advance": 2.0,
}
"""How often an oracle walk picks each op kind among the enabled ones (1 when not listed)."""


def oracle_config(rng: random.Random) -> OracleConfig:
    cp = rng.choice([0, 0, 1, 2])
    nodes = rng.randint(2, 3)
    page = rng.choice([1, 2])
    return OracleConfig(
        page_size=page,
        layer_num=rng.randint(1, 2),
        draft_layer_num=rng.choice([0, 0, 1]),
        device_pages=rng.randint(4, 7),
        host_pages=rng.randint(3, 6),
        draft_host_pages=rng.randint(3, 6),
        cp_size=cp,
        num_counters=rng.choice([2, 3]),
        node_tokens=tuple(rng.randint(1, 2 * page) for _ in range(nodes)),
    )


def oracle_vector(seed: int, index: int) -> Vector:
    """A seeded walk over the oracle's enabled ops, translated to harness steps and recorded
    on the reference (a translated step the session does not enable is left out)."""
    rng = random.Random(f"oracle:{seed}:{index}")
    config = oracle_config(rng)
    state = initial_state(config)
    universe = all_ops(config)
    ops = []
    for _ in range(rng.randint(10, 30)):
        enabled = enabled_ops(state, universe)
        if not enabled:
            break
        weights = [ORACLE_WEIGHTS.get(type(op).__name__, 1.0) for op in enabled]
        op = rng.choices(enabled, weights=weights)[0]
        try:
            state, _ = step(state, op)
        except OpNotEnabledError:
            continue
        ops.append(op)
    # the forward finishes the layers it began (quiescence reads every layer of a resident node)
    stores = [op for op in universe if isinstance(op, Store)]
    while pending := [op for op in stores if why_disabled(state, op) is None]:
        state, _ = step(state, pending[0])
        ops.append(pending[0])
    harness = harness_config_for(config, seed=rng.randrange(1 << 16))
    recorder = Recorder(
        harness,
        vector_id=f"oracle-{index:04d}",
        title=f"seeded walk {index} over the oracle's ops ({harness.describe()})",
        kind="oracle",
    )
    for translated in steps_for_ops(ops, config):
        recorder.offer(translated)
    return recorder.vector()
