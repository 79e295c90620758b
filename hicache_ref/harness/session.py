"""A Session applies trace steps to one world: preconditions, the rule, then every check.

The Hypothesis machines, the trace replayer and the minimizer all go through ``Session.apply``,
so a step means the same thing everywhere. A step whose precondition does not hold is recorded
as skipped (this is what lets the minimizer delete steps freely). After every applied step the
session checks the invariants that are cheap enough to check always; ``finish()`` runs the
quiescence checks: every stream idle, every ack drained exactly once, every slot free or owned
by one node, every resident copy holding the bytes the content oracle predicts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import Implementation, unsupported_reasons
from hicache_ref.harness.config import HarnessConfig
from hicache_ref.harness.trace import Step, Trace, TraceHeader
from hicache_ref.harness.tree import Node, TreeDriver
from hicache_ref.harness.world import build_world

STREAMS = ("forward", "write", "load")
DRAIN_ROUNDS_MAX = 10_000


@dataclass
class SessionStats:
    steps: int = 0
    skipped: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0


class Session:
    """One case: a world, its tree driver, the steps applied so far, and the checks."""

    def __init__(
        self, config: HarnessConfig, implementation: Implementation, impl_name: str
    ) -> None:
        reasons = unsupported_reasons(implementation.capabilities, config)
        if reasons:
            raise ValueError(
                f"implementation {impl_name!r} does not support {config.describe()}: needs {reasons}"
            )
        self.config = config
        self.implementation = implementation
        self.impl_name = impl_name
        self.world = build_world(config, implementation)
        self.tree = TreeDriver(self.world)
        self.steps: list[Step] = []
        self.outcomes: list[str] = []
        self.stats = SessionStats()
        self._candidates: dict[str, list[int]] = {}

    # -- the trace -----------------------------------------------------------------------------
    def trace(self, note: str = "") -> Trace:
        header = TraceHeader(implementation=self.impl_name, config=self.config, note=note)
        return Trace(header=header, steps=tuple(self.steps))

    # -- candidates (what a rule may pick) ----------------------------------------------------
    def candidates(self, rule: str) -> list[int]:
        """Node handles ``rule`` may act on now (cached until the next step is applied)."""
        cached = self._candidates.get(rule)
        if cached is None:
            cached = self._compute_candidates(rule)
            self._candidates[rule] = cached
        return cached

    def _compute_candidates(self, rule: str) -> list[int]:
        t = self.tree
        total = t.total_layers
        if rule == "write":
            return t.handles(
                lambda n: n.on_device and n.layers_stored == total and n.backup == "none"
            )
        if rule == "load":
            if len(self._acks("ack_load_queue")) + 1 > self.config.num_counters:
                return []
            return t.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)
        if rule == "forward_read":
            return t.handles(
                lambda n: (
                    n.on_device
                    and n.layers_stored > 0
                    and (not n.loading or n.producer_id is not None)
                )
            )
        if rule == "probe_evict_host":
            return [h for h in t.handles(lambda n: n.backup == "in_flight") if t.write_in_flight(h)]
        if rule == "probe_evict_device":
            return [
                h
                for h in t.handles(lambda n: n.on_device)
                if t.write_in_flight(h) or t.load_in_flight(h)
            ]
        if rule == "probe_rewrite":
            return t.handles(lambda n: n.backup == "in_flight" and n.on_device)
        if rule == "cancel":
            return [
                h
                for h in t.handles(lambda n: n.backup == "in_flight")
                if t.has_pending_layer_write(h)
            ]
        if rule == "evict_device":
            return t.handles(
                lambda n: (
                    n.on_device and n.backup == "done" and not n.loading and n.pending_reads == 0
                )
            )
        if rule == "drop":
            return t.handles(lambda n: n.on_device and n.backup == "none" and not n.loading)
        if rule == "evict_host":
            return t.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)
        return []

    def _acks(self, queue: str) -> list[Any]:
        return list(getattr(self.world.ranks[0].controller, queue))

    def is_enabled(self, step: Step) -> bool:
        rule, args = step.rule, step.args
        if rule == "forward_layer":
            return bool(self.tree.batch)
        if rule.startswith("probe_"):
            return "guards" in self.implementation.capabilities and int(
                args.get("node", -1)
            ) in self.candidates(rule)
        if rule in ("write", "load", "cancel", "evict_device", "drop", "evict_host"):
            return int(args.get("node", -1)) in self.candidates(rule)
        if rule == "forward_read":
            node = self.tree.node(int(args.get("node", -1)))
            if node is None or int(args.get("node", -1)) not in self.candidates(rule):
                return False
            layer, draft = int(args.get("layer", 0)), bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= layer < min(limit, node.layers_stored)
        if rule in ("store_layer", "reserve", "submit_layer"):
            node = self.tree.node(int(args.get("node", -1)))
            if node is None or not node.on_device:
                return False
            if rule == "reserve":
                return self.config.uses_cp and node.backup == "none" and not node.loading
            if rule == "submit_layer":
                return bool(node.reservations) and node.backup == "in_flight"
            draft = bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= int(args.get("layer", -1)) < limit and not node.loading
        if rule == "layer_end":
            draft = bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= int(args.get("layer", -1)) < limit
        if rule == "start_loading":
            return bool(self.tree.queued_loads) and (
                len(self._acks("ack_load_queue")) < self.config.num_counters
            )
        if rule == "advance":
            return args.get("stream") in STREAMS and int(args.get("n", 0)) >= 1
        if rule == "synchronize":
            return args.get("stream") in STREAMS
        if rule == "prefill":
            handle = int(args.get("handle", self.tree.next_handle))
            return int(args.get("tokens", 0)) >= 1 and handle not in self.tree.nodes
        return rule in ("start_writing", "drain_acks", "drain_write", "drain_load", "reset", "noop")

    # -- applying steps ------------------------------------------------------------------------
    def apply(self, step: Step) -> str:
        self._candidates.clear()
        try:
            return self._apply(step)
        finally:
            self._candidates.clear()

    def _apply(self, step: Step) -> str:
        if step.rule == "prefill" and "handle" not in step.args:
            # Name the node in the step itself, so deleting earlier steps (ddmin) keeps every
            # later reference to it valid.
            step = Step(rule="prefill", args={**step.args, "handle": self.tree.next_handle})
        self.steps.append(step)
        self.stats.steps += 1
        if not self.is_enabled(step):
            self.stats.skipped += 1
            self.outcomes.append("skipped")
            return "skipped"
        self.stats.rules[step.rule] += 1
        outcome = self._dispatch(step)
        self.outcomes.append(outcome)
        self.check_step_invariants()
        return outcome

    def _dispatch(self, step: Step) -> str:
        t, a = self.tree, step.args
        handlers: dict[str, Callable[[], str]] = {
            "prefill": lambda: t.prefill(
                int(a["tokens"]),
                bool(a.get("early_reserve", False)),
                int(a["handle"]),
                batch=bool(a.get("batch", True)),
            ),
            "store_layer": lambda: t.store_layer(int(a["node"]), int(a["layer"]), bool(a["draft"])),
            "layer_end": lambda: t.layer_end(int(a["layer"]), bool(a["draft"])),
            "reserve": lambda: t.reserve(int(a["node"])),
            "submit_layer": lambda: t.submit_layer(
                int(a["node"]), int(a["layer"]), bool(a["draft"])
            ),
            "drain_write": t.writing_check,
            "drain_load": t.loading_check,
            "forward_layer": t.forward_layer,
            "write": lambda: t.write_backup(int(a["node"])),
            "start_writing": self._start_writing,
            "load": lambda: t.load_back(int(a["node"])),
            "start_loading": t.start_loading,
            "forward_read": lambda: t.forward_read(
                int(a["node"]), int(a["layer"]), bool(a["draft"])
            ),
            "advance": lambda: self._advance(str(a["stream"]), int(a["n"])),
            "synchronize": lambda: self._synchronize(str(a["stream"])),
            "drain_acks": lambda: f"{t.writing_check()}; {t.loading_check()}",
            "cancel": lambda: t.cancel_backup(int(a["node"])),
            "evict_device": lambda: t.evict_device(int(a["node"])),
            "drop": lambda: t.drop(int(a["node"])),
            "evict_host": lambda: t.evict_host(int(a["node"])),
            "reset": t.reset,
            "probe_evict_host": lambda: t.probe("evict_host", int(a["node"])),
            "probe_evict_device": lambda: t.probe("evict_device", int(a["node"])),
            "probe_rewrite": lambda: t.probe("rewrite", int(a["node"])),
            "noop": lambda: "noop",
        }
        return handlers[step.rule]()

    def _start_writing(self) -> str:
        for rank in self.world.ranks:
            rank.controller.start_writing()
        return "start_writing"

    def _advance(self, stream: str, n: int) -> str:
        device = self.world.device
        if stream == "forward":
            return f"forward ran {device.advance(device.default_stream, n)} op(s)"
        ran = [
            device.advance(getattr(rank.controller, f"{stream}_stream"), n)
            for rank in self.world.ranks
        ]
        return f"{stream} ran {ran} op(s)"

    def _synchronize(self, stream: str) -> str:
        """Host waits for a stream (what cancel_layer_write_state and a CPU read do)."""
        if stream == "forward":
            self.world.device.default_stream.synchronize()
        else:
            for rank in self.world.ranks:
                getattr(rank.controller, f"{stream}_stream").synchronize()
        return f"synchronized {stream}"

    # -- checks --------------------------------------------------------------------------------
    def check_step_invariants(self) -> None:
        self.stats.invariant_checks += 1
        controllers = [rank.controller for rank in self.world.ranks]
        rows0_w = [list(a.node_ids) for a in controllers[0].ack_write_queue]
        rows0_l = [list(a.node_ids) for a in controllers[0].ack_load_queue]
        for rank_index, controller in enumerate(controllers):
            rows = [list(a.node_ids) for a in controller.ack_write_queue]
            # Verify at most one undrained write ack per node (INV-02)
            flat = [n for row in rows for n in row if n >= 0]
            dupes = sorted({n for n in flat if flat.count(n) > 1})
            if dupes:
                raise InvariantViolation(
                    "INV-02", f"rank {rank_index}: node(s) {dupes} have two undrained write acks"
                )
            gate = getattr(controller, "node_has_undrained_write_ack", None)
            if gate is not None:
                for node in self.tree.nodes.values():
                    if gate(node.node_id) != (node.node_id in flat):
                        raise InvariantViolation(
                            "INV-02",
                            f"rank {rank_index}: node_has_undrained_write_ack({node.node_id}) is "
                            f"{gate(node.node_id)} but the queue scan says {node.node_id in flat}",
                        )
            # Verify every rank carries identical ack rows (INV-14)
            if rows != rows0_w or [list(a.node_ids) for a in controller.ack_load_queue] != rows0_l:
                raise InvariantViolation("INV-14", f"rank {rank_index} ack rows differ from rank 0")
            # Verify the producer slots are never oversubscribed (INV-10)
            if len(controller.ack_load_queue) > self.config.num_counters:
                raise InvariantViolation(
                    "INV-10",
                    f"{len(controller.ack_load_queue)} undrained load acks exceed "
                    f"num_counters={self.config.num_counters}",
                )
        self.check_slot_conservation()

    def check_slot_conservation(self) -> None:
        """Every page is free or owned by exactly one live node (INV-05)."""
        page = self.config.page_size
        for rank_index, rank in enumerate(self.world.ranks):
            device_owned: dict[int, int] = {}
            host_owned: dict[int, int] = {}
            draft_owned: dict[int, int] = {}
            for node in self.tree.nodes.values():
                if node.value is not None:
                    for p in _pages(node.value, page):
                        _claim(device_owned, p, node, "device page", rank_index)
                for pool_name, slots in self._host_slots(rank_index, node):
                    table = host_owned if pool_name == "host" else draft_owned
                    for p in _pages(slots, page):
                        _claim(table, p, node, f"{pool_name} page", rank_index)
            _compare(
                set(device_owned),
                set(rank.allocator.allocated_page_ids()),
                f"rank {rank_index} device allocator",
            )
            _compare(
                set(host_owned),
                set(rank.host_pool.allocated_pages()),
                f"rank {rank_index} host pool",
            )
            if self.config.uses_cp and rank.draft_host_pool is not None:
                _compare(
                    set(draft_owned),
                    set(rank.draft_host_pool.allocated_pages()),
                    f"rank {rank_index} draft host pool",
                )

    def _host_slots(self, rank_index: int, node: Node) -> list[tuple[str, Any]]:
        if self.config.uses_cp:
            meta = node.cp_meta[rank_index]
            if meta is None:
                return []
            out = [("host", meta.host_indices)]
            if meta.draft_host_indices is not None:
                out.append(("draft_host", meta.draft_host_indices))
            return out
        host = node.host_value[rank_index]
        return [("host", host)] if host is not None else []

    def finish(self) -> None:
        """Quiescence: run everything, drain everything, then check every byte and slot (INV-16)."""
        t = self.tree
        # The forward finishes computing every node (early-reserved backups ack only then)
        while t.batch:
            t.forward_layer()
        # Nodes stored layer by layer (oracle traces): the forward finishes their layers too
        pending = [h for h in t.nodes if t.has_pending_layer_write(h)]
        for handle in pending:
            for draft, layer_num in t._layer_kinds():
                for layer in range(layer_num):
                    t.store_layer(handle, layer, draft)
        if pending:
            for draft, layer_num in t._layer_kinds():
                for layer in range(layer_num):
                    t.layer_end(layer, draft)
        if t.queued_loads:
            while len(self._acks("ack_load_queue")) >= self.config.num_counters:
                self.world.device.run_until_idle()
                t.loading_check()
            t.start_loading()
        for _ in range(DRAIN_ROUNDS_MAX):
            self.world.device.run_until_idle()
            t.writing_check()
            t.loading_check()
            if not t.ongoing_write and not t.ongoing_load:
                break
        else:
            raise InvariantViolation("INV-16", "acks never drained at quiescence")
        for controller in (rank.controller for rank in self.world.ranks):
            if controller.ack_write_queue or controller.ack_load_queue:
                raise InvariantViolation(
                    "INV-16", "acks left in a queue at quiescence (an extra ack for some node)"
                )
        pending = [h for h in t.nodes if t.has_pending_layer_write(h)]
        for node in t.nodes.values():
            if node.on_device and node.layers_stored == t.total_layers:
                t.check_device_bytes(node, "INV-06", "quiescence")
            if node.backup == "done":
                t.check_host_bytes(node, "INV-06", "quiescence")
        self.check_slot_conservation()
        if any(t.nodes[h].backup != "in_flight" for h in pending):
            raise InvariantViolation("INV-15", "a pending layer write outlived its node's backup")


_PAGES_CACHE: dict[int, tuple[Any, int, list[int]]] = {}
_PAGES_CACHE_BOUND = 4096


def _pages(indices: Any, page: int) -> list[int]:
    """The pages an index tensor covers (cached per tensor: node tensors never change)."""
    hit = _PAGES_CACHE.get(id(indices))
    if hit is not None and hit[0] is indices and hit[1] == page:
        return hit[2]
    pages: list[int] = torch.unique(indices // page).tolist() if indices.numel() else []
    if len(_PAGES_CACHE) >= _PAGES_CACHE_BOUND:
        _PAGES_CACHE.clear()
    _PAGES_CACHE[id(indices)] = (indices, page, pages)  # holds the tensor: its id stays unique
    return pages


def _claim(table: dict[int, int], page: int, node: Node, what: str, rank: int) -> None:
    holder = table.get(page)
    if holder is not None and holder != node.handle:
        raise InvariantViolation(
            "INV-05", f"rank {rank}: {what} {page} is owned by nodes {holder} and {node.handle}"
        )
    table[page] = node.handle


def _compare(expected: set[int], actual: set[int], what: str) -> None:
    if expected == actual:
        return
    leaked = sorted(actual - expected)
    lost = sorted(expected - actual)
    raise InvariantViolation(
        "INV-05",
        f"{what}: pages allocated but owned by no node {leaked[:8]}; pages owned by a node but "
        f"free {lost[:8]} (every page is free or owned by exactly one node)",
    )
