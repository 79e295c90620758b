"""Mutants that make CP ranks disagree are caught by the cross-process comparison.

Each mutant's zero-owned rank (a rank owning no page of a small node) acks or loads
differently from the owner: the ranks' digests differ after the step, every rank raises the
same INV-14 message with the same replay line, rank 0's trace records two processes, and
``hicache-fuzz replay`` of it spawns two processes again and fails the same way. One campaign
goes through ``hicache-fuzz run --cp-processes 2 --json``, the other through the API.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_ref import cli
from hicache_ref.distributed.campaign import run_cp_campaign
from hicache_ref.harness.steps.trace import Trace


def _campaign_failures(mutant: str, out: Path, via_cli: bool) -> list[list[tuple[str, str]]]:
    """Each rank's (message, trace) failures of a seeded 2-rank campaign against ``mutant``."""
    if via_cli:
        report_file = out / "report.json"
        argv = ["run", "--cp-processes", "2", "--impl", f"mutant:{mutant}", "--seconds", "60"]
        argv += ["--out", str(out), "--json", str(report_file), "--no-progress"]
        assert cli.main(argv) == 1
        data = json.loads(report_file.read_text())
        assert data["cp_processes"] == 2 and data["backend"] == "gloo"
        assert [f["invariant"] for f in data["failures"]] == ["INV-14"]
        assert not data["rank_problems"]
        return [[(f["message"], f["trace"]) for f in r["failures"]] for r in data["ranks"]]
    report = run_cp_campaign(
        f"mutant:{mutant}",
        processes=2,
        seconds=60,
        cases_max=6,
        steps_per_case=60,
        seed=0,
        out_dir=out,
        progress=False,
    )
    assert [f.signature for f in report.failures] == ["INV-14"], report.render()
    assert not report.rank_errors
    return [[(f.message, f.trace) for f in r.failures] for r in report.ranks]


@pytest.mark.parametrize(
    ("mutant", "what", "via_cli"),
    [
        # a zero-owned rank appends no write ack: its write rows lack the node
        ("drop_zero_owned_ack", "write_rows differ", True),
        # a zero-owned rank queues no load op: its start_loading returns -1
        ("zero_owned_rank_skips_load_op", "start_loading -> producer -1", False),
    ],
)
def test_mutant_is_caught_on_every_rank_and_replays(
    mutant: str, what: str, via_cli: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    per_rank = _campaign_failures(mutant, tmp_path, via_cli)
    # every rank reports the same one failure: the same message and the same replay line
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    ((message, trace_path),) = per_rank[0]
    assert message.startswith("INV-14 violated: CP ranks diverge at step ")
    assert what in message
    trace = Trace.read(Path(trace_path))
    assert trace.header.cp_processes == 2
    assert "backend=gloo" in trace.header.note
    # hicache-fuzz replay TRACE: spawns the two ranks again -> the same verdict, exit 1
    capsys.readouterr()
    assert cli.main(["replay", trace_path]) == 1
    assert f"FAILED on 2 processes (gloo): {message}" in capsys.readouterr().out
