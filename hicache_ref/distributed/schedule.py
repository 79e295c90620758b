"""The schedule every rank follows: a seeded configuration per case, and a seeded step program
that rank 0 draws from its own session (the ranks agree, so its candidates are everyone's).

``draw_cp_config`` picks a CP world the implementation supports, with small nodes so that
ranks owning no page of a node (zero-owned ranks) are common. ``StepProgram`` draws one rule at
a time among those the session enables, and, like the Hypothesis machine, spends many steps in
compound programs (``round_trip``: write -> sync -> drain -> evict_device -> load ->
start_loading -> reads while it loads -> part of the H2D -> drain) that reach the load path. A
compound's later steps are drawn ahead; one that is no longer enabled is skipped by agreement.
Layer-end hooks fire only inside ``forward_layer`` (after that layer's stores) and a layer is
submitted only once stored: a hook or submit ahead of the store would copy bytes never written,
a fault of the schedule and not of the implementation.
"""

from __future__ import annotations

import random
from collections import deque

from hicache_ref.harness.adapters.base import supports
from hicache_ref.harness.config import LEGAL_LAYOUTS, MHA_ONLY_LAYOUTS, HarnessConfig
from hicache_ref.harness.session import STREAMS, Session
from hicache_ref.harness.trace import Step, StepArg

CONFIG_DRAWS_MAX = 200
RULE_WEIGHTS: dict[str, int] = {
    "prefill": 10,
    "forward_layer": 8,
    "write": 6,
    "round_trip": 8,
    "offload": 4,
    "load": 4,
    "start_loading": 4,
    "forward_read": 5,
    "advance": 8,
    "synchronize": 3,
    "drain_acks": 8,
    "drain_write": 2,
    "drain_load": 2,
    "start_writing": 1,
    "evict_device": 3,
    "evict_host": 2,
    "drop": 2,
    "cancel": 2,
    "reserve": 2,
    "probe": 2,
    "reset": 1,
}
NODE_RULES = ("write", "load", "evict_device", "evict_host", "drop", "cancel")


def draw_cp_config(
    rng: random.Random, cp_size: int, capabilities: frozenset[str]
) -> HarnessConfig | None:
    """A CP configuration of ``cp_size`` ranks the implementation supports (None: none found)."""
    assert cp_size >= 1, f"cp_size must be >= 1, got {cp_size}"
    for _ in range(CONFIG_DRAWS_MAX):
        io_backend = rng.choice(["direct", "kernel"])
        layouts = [name for name in LEGAL_LAYOUTS[io_backend] if name not in MHA_ONLY_LAYOUTS]
        layer_num = rng.randint(1, 3)
        draft = max(0, rng.choice([0, 0, layer_num - 1, layer_num + 1]))
        config = HarnessConfig.model_validate(
            {
                "page_size": rng.choice([1, 2, 2, 4]),
                "layer_num": layer_num,
                "draft_layer_num": draft,
                "pool_kind": "nsa",
                "layout": rng.choice(layouts),
                "io_backend": io_backend,
                "cp_size": cp_size,
                "device_pages": rng.randint(2 * cp_size + 6, 2 * cp_size + 30),
                "host_pages": rng.randint(2, 24),
                "alloc_policy": rng.choice(["fifo", "lifo", "random"]),
                "draft_alloc_policy": rng.choice(["fifo", "lifo", "random"]),
                "draft_host_pages": rng.randint(1, 24) if draft else 0,
                "num_counters": rng.choice([2, 5]),
                "settle_records": rng.random() < 0.5,
                "copy_path": rng.choice(["gather", "runs"]),
                "hybrid": rng.random() < 0.2,
                "seed": rng.randint(0, 2**16),
            }
        )
        if supports(capabilities, config):
            return config
    return None


class StepProgram:
    """Rank 0's seeded program: ``next_step(session)`` is the next step, None when it ends."""

    def __init__(self, seed: int, steps_max: int, *, probes: bool = True) -> None:
        assert steps_max >= 1, f"a program needs at least one step, got {steps_max}"
        self.rng = random.Random(seed)
        self.weights = {r: w for r, w in RULE_WEIGHTS.items() if probes or r != "probe"}
        self.steps_left = steps_max
        self.ahead: deque[Step] = deque()

    def next_step(self, session: Session) -> Step | None:
        if self.steps_left <= 0:
            return None
        self.steps_left -= 1
        if not self.ahead:
            self.ahead.extend(self._draw(session))
        return self.ahead.popleft() if self.ahead else Step(rule="noop")

    # -- drawing ---------------------------------------------------------------------------------
    def _draw(self, session: Session) -> list[Step]:
        rules = list(self.weights)
        for _ in range(8):
            rule = self.rng.choices(rules, weights=[self.weights[r] for r in rules])[0]
            steps = self._program(session, rule)
            if steps:
                return steps
        return [self._prefill(session)]

    def _program(self, session: Session, rule: str) -> list[Step]:
        rng, tree = self.rng, session.tree
        if rule == "prefill":
            steps = [self._prefill(session)]
            if rng.random() < 0.7:
                steps += [Step(rule="forward_layer")] * tree.total_layers
            return steps
        if rule in NODE_RULES:
            return self._on_node(session, rule, {})
        if rule == "round_trip":
            return self._round_trip(session)
        if rule == "offload":
            node = self._pick(session, "write")
            if node is None:
                return []
            return [
                _step("write", node=node),
                _step("synchronize", stream="write"),
                _step("drain_acks"),
                _step("evict_device", node=node),
            ]
        if rule == "reserve":
            handles = tree.handles(lambda n: n.on_device and n.backup == "none")
            if not handles:
                return []
            node = rng.choice(handles)
            steps = [_step("reserve", node=node)]
            if tree.nodes[node].layers_stored > 0 and rng.random() < 0.5:
                # a layer's D2H only after its KV store (the layer-end hook's order, INV-12)
                steps.append(_step("submit_layer", node=node, layer=0, draft=False))
            return steps
        if rule == "forward_read":
            return self._read(session)
        if rule == "advance":
            return [_step("advance", stream=rng.choice(STREAMS), n=rng.randint(1, 8))]
        if rule == "synchronize":
            return [_step("synchronize", stream=rng.choice(STREAMS))]
        if rule == "probe":
            kind = rng.choice(["evict_host", "evict_device", "rewrite"])
            return self._on_node(session, f"probe_{kind}", {})
        if rule == "reset" and len(tree.nodes) < 3:
            return []
        step = _step(rule)
        return [step] if session.is_enabled(step) else []

    def _prefill(self, session: Session) -> Step:
        config = session.config
        small = config.page_size * config.cp_size  # at most one page per rank: zero-owned ranks
        tokens = self.rng.randint(1, small) if self.rng.random() < 0.7 else self.rng.randint(1, 40)
        return _step("prefill", tokens=tokens, handle=session.tree.next_handle)

    def _pick(self, session: Session, rule: str) -> int | None:
        candidates = session.candidates(rule)
        return self.rng.choice(candidates) if candidates else None

    def _on_node(self, session: Session, rule: str, extra: dict[str, StepArg]) -> list[Step]:
        node = self._pick(session, rule)
        return [] if node is None else [Step(rule=rule, args={"node": node, **extra})]  # type: ignore[arg-type]

    def _read(self, session: Session, node: int | None = None) -> list[Step]:
        node = self._pick(session, "forward_read") if node is None else node
        if node is None:
            return []
        config = session.config
        draft = config.has_draft and self.rng.random() < 0.4
        limit = config.draft_layer_num if draft else config.layer_num
        return [_step("forward_read", node=node, layer=self.rng.randrange(limit), draft=draft)]

    def _round_trip(self, session: Session) -> list[Step]:
        rng = self.rng
        node = self._pick(session, "write")
        steps: list[Step] = []
        if node is not None:
            steps += [
                _step("write", node=node),
                _step("synchronize", stream="write"),
                _step("drain_acks"),
            ]
        else:
            node = self._pick(session, "evict_device")
            if node is None:
                return []
        steps += [_step("evict_device", node=node), _step("load", node=node)]
        steps.append(_step("start_loading"))
        config = session.config
        for _ in range(rng.randint(1, 4)):
            draft = config.has_draft and rng.random() < 0.4
            limit = config.draft_layer_num if draft else config.layer_num
            steps.append(_step("forward_read", node=node, layer=rng.randrange(limit), draft=draft))
        steps.append(_step("advance", stream="load", n=rng.randint(1, 6)))
        steps.append(_step("advance", stream="forward", n=rng.randint(1, 6)))
        if rng.random() < 0.5:
            steps += [_step("synchronize", stream="load"), _step("drain_load")]
        return steps


def _step(rule: str, **args: StepArg) -> Step:
    return Step(rule=rule, args=dict(args))  # type: ignore[arg-type]


def quiesce_steps() -> list[Step]:
    """What every case ends with before ``finish``: every stream run, then one agreed drain."""
    return [_step("synchronize", stream=s) for s in STREAMS] + [_step("drain_acks")]
