"""Replay an oracle trace on a controller: translate oracle ops into harness steps.

The bounded model checker (``hicache_ref.formal.bounded``) returns the shortest op trace that
breaks an invariant of a (planted) protocol variant. ``steps_for_ops`` turns it into a harness
trace, so the same program runs against a real implementation through the tree driver: a
controller that carries the planted bug must fail it, and the reference must pass it.

The translation is exact for every tree/controller call; ``Advance(stream)`` becomes one
``advance(stream, 1)`` of the simulated device, whose ops are finer-grained than the oracle's,
so a translated trace is a valid program with the same calls but possibly a gentler schedule.

Every op becomes steps of the harness's atomic rules (``rules.RULES``, the same records the
session applies, named by their constants), so an oracle ``process_*`` transition meets the harness rule of the same verb:
``Store`` -> ``store_layer``, ``OnLayerEnd`` -> ``layer_end``, ``ReserveWriteCp`` -> ``reserve``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.harness.rules.evict import DROP, EVICT_DEVICE, EVICT_HOST
from hicache_ref.harness.rules.forward import LAYER_END, PREFILL, STORE_LAYER
from hicache_ref.harness.rules.load import DRAIN_LOAD, FORWARD_READ, LOAD, START_LOADING
from hicache_ref.harness.rules.reset import NOOP, RESET
from hicache_ref.harness.rules.streams import ADVANCE
from hicache_ref.harness.rules.write import CANCEL, DRAIN_WRITE, RESERVE, SUBMIT_LAYER, WRITE
from hicache_ref.harness.steps.programs import step
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.oracle import ops as o
from hicache_ref.oracle.config import OracleConfig


def harness_config_for(config: OracleConfig, *, seed: int = 0) -> HarnessConfig:
    """The simulated world matching an oracle world (one extra device page: page 0 is reserved)."""
    return HarnessConfig(
        page_size=config.page_size,
        layer_num=config.layer_num,
        draft_layer_num=config.draft_layer_num,
        pool_kind="nsa" if config.uses_cp else "mha",
        layout="layer_first",
        io_backend="direct",
        cp_size=config.cp_size,
        device_pages=max(config.device_pages + 1, 2 * config.num_ranks),
        host_pages=config.host_pages,
        draft_host_pages=config.draft_host_pages if config.uses_cp and config.has_draft else 0,
        num_counters=max(2, config.num_counters),
        settle_records=config.settle_records,
        seed=seed,
    )


def steps_for_ops(ops: Sequence[o.Op], config: OracleConfig) -> tuple[Step, ...]:
    steps: list[Step] = []
    backed: set[int] = set()  # nodes with a backup (evict_device keeps them; else they drop)
    for op in ops:
        steps.extend(_translate(op, config, backed))
    return tuple(steps)


def _translate(op: o.Op, config: OracleConfig, backed: set[int]) -> list[Step]:
    if isinstance(op, o.Insert):
        tokens = config.node_tokens[op.node]
        return [step(PREFILL, tokens=tokens, early_reserve=False, handle=op.node, batch=False)]
    if isinstance(op, o.Store):
        return [step(STORE_LAYER, node=op.node, layer=op.layer, draft=op.pool == "draft")]
    if isinstance(op, o.Write | o.ReserveWriteCp):
        backed.add(op.node)
        return [step(WRITE if isinstance(op, o.Write) else RESERVE, node=op.node)]
    if isinstance(op, o.SubmitLayer):
        return [step(SUBMIT_LAYER, node=op.node, layer=op.layer, draft=op.pool == "draft")]
    if isinstance(op, o.OnLayerEnd):
        return [step(LAYER_END, layer=op.layer, draft=op.source == "draft")]
    if isinstance(op, o.CancelLayerWrite):
        backed.discard(op.node)
        return [step(CANCEL, node=op.node)]
    if isinstance(op, o.DrainWriteAcks):
        return [step(DRAIN_WRITE)]
    if isinstance(op, o.DrainLoadAcks):
        return [step(DRAIN_LOAD)]
    if isinstance(op, o.EvictDevice):
        return [step(EVICT_DEVICE if op.node in backed else DROP, node=op.node)]
    if isinstance(op, o.EvictHost):
        backed.discard(op.node)
        return [step(EVICT_HOST, node=op.node)]
    if isinstance(op, o.Load):
        return [step(LOAD, node=op.node)]
    if isinstance(op, o.StartLoading):
        return [step(START_LOADING)]
    if isinstance(op, o.ForwardRead):
        return [step(FORWARD_READ, node=op.node, layer=op.layer, draft=op.pool == "draft")]
    if isinstance(op, o.Advance):
        return [step(ADVANCE, stream=op.stream, n=1)]
    if isinstance(op, o.Reset):
        backed.clear()
        return [step(RESET)]
    return [step(NOOP)]  # Noop, and CopyLanded (a harness report, not a call)


def trace_for_ops(
    ops: Sequence[o.Op], config: OracleConfig, *, implementation: str, note: str = ""
) -> Trace:
    header = TraceHeader(
        implementation=implementation, config=harness_config_for(config), note=note
    )
    return Trace(header=header, steps=steps_for_ops(ops, config))
