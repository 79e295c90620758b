"""The bounded checker's shortest counterexamples replay on controllers.

For each planted protocol bug that has a controller mutant re-creating it, the oracle's
shortest failing trace, translated into harness steps, must fail on that mutant with an
invariant violation and pass on the reference: the model and the controller agree on what the
bug is (INV-02, INV-03, INV-14, INV-12/INV-09, INV-04/INV-09).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.formal.bounded import explore, main
from hicache_ref.harness.lockstep.from_oracle import trace_for_ops
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.oracle.config import OracleConfig, make_variant

WORLD = {"page_size": 2, "layer_num": 2, "device_pages": 4, "host_pages": 4,
         "draft_host_pages": 4, "node_tokens": (2, 2)}  # fmt: skip

# planted oracle flag -> (controller mutant, extra world settings)
PAIRS = {
    "duplicate_write_ack": ("extra_write_ack", {}),
    "skip_owner_replay": ("skip_owner_replay", {"cp_size": 2}),
    "zero_owned_rank_drops_load": ("zero_owned_rank_skips_load_op", {"cp_size": 2}),
    "no_fence_before_d2h": ("skip_write_fence", {}),
    "skip_draft_layers": ("draft_layer_counted_with_target", {"cp_size": 1, "draft_layer_num": 2}),
}


@pytest.mark.parametrize("flag", sorted(PAIRS))
def test_shortest_oracle_counterexample_fails_the_matching_mutant(flag: str) -> None:
    mutant, extra = PAIRS[flag]
    config = OracleConfig(variant=make_variant(flag), **{**WORLD, **extra})  # type: ignore[arg-type]
    result = explore(config, max_depth=30)
    assert not result.ok, result.summary()
    trace = trace_for_ops(result.trace, config, implementation=f"mutant:{mutant}")
    on_mutant = replay(trace)
    assert on_mutant.failed and on_mutant.signature().startswith("INV-"), on_mutant.outcomes
    assert not replay(trace, implementation="reference").failed


def test_correct_protocol_traces_pass_on_the_reference() -> None:
    # a correct-protocol program (the planted trace minus its bug) is a valid controller program
    config = OracleConfig(variant=make_variant("load_ack_before_last_layer"), **WORLD)  # type: ignore[arg-type]
    result = explore(config, max_depth=30)
    assert not result.ok
    trace = trace_for_ops(result.trace, config, implementation="reference")
    assert not replay(trace).failed
    assert "skipped" not in replay(trace).outcomes


def test_bounded_cli_writes_a_replayable_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cex.jsonl"
    code = main(["--nodes", "1", "--variant", "duplicate_write_ack", "--max-depth", "8",
                 "--trace-out", str(out), "--impl", "mutant:extra_write_ack"])  # fmt: skip
    assert code == 1
    assert f"hicache-fuzz replay {out}" in capsys.readouterr().out
    assert replay(Trace.read(out)).failed
