"""Workers and their merged report: what each worker is handed, what it sends, how they add up.

The spawned path itself (processes, Ctrl-C forwarding) is exercised end to end by
``tests/test_cli.py::test_ctrl_c_stops_every_worker_and_writes_the_merged_report``; here each
piece runs in this process.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.rounds import CampaignSignals
from hicache_ref.device.perturb import Perturbation
from hicache_ref.fleet import workers
from hicache_ref.fleet.merge import merge_reports, report_from_json
from hicache_ref.fleet.shards import Shard
from hicache_ref.fleet.workers import WorkerTask, plan_workers, run_and_report, run_worker

SPINS = Perturbation(probability=0.25, cycles_min=100, cycles_max=200, paces=True)


def _leaf(worker: int, **counts: Any) -> CampaignReport:
    report = CampaignReport("reference", "ci", worker, seed_stride=2, worker=worker, workers=2)
    for name, value in counts.items():
        setattr(report, name, value)
    return report


def _failure(invariant: str, at_s: float) -> dict[str, Any]:
    return {"invariant": invariant, "found_at_s": at_s, "error": invariant, "seed": "0"}


def test_two_workers_add_up_to_one_report() -> None:
    early, late = _failure("INV-02", 1.0), _failure("INV-02", 0.5)
    one = _leaf(0, cases=3, steps=30, seconds=10.0, failures=[early], rules=Counter(write=3))
    other = _leaf(1, cases=4, steps=50, seconds=12.0, failures=[late], rules=Counter(write=1))
    one.config_first_s, other.config_first_s = {"mha 1L": 2.0}, {"mha 1L": 1.5, "mla 2L": 3.0}
    merged = merge_reports([one, other])
    assert (merged.cases, merged.steps, merged.seconds) == (7, 80, 12.0)
    assert merged.rules == Counter(write=4) and merged.workers == 2 and merged.worker is None
    # the earliest INV-02 is the failure; the other worker's is a repeat
    assert merged.failures == [{**late, "worker": 1}] and merged.repeats == Counter({"INV-02": 1})
    assert merged.config_first_s == {"mha 1L": 1.5, "mla 2L": 3.0}
    # two lanes of stride 2 interleave into every seed from 0
    assert (merged.seed, merged.seed_stride) == (0, 1)
    assert merged.parts == [one, other]


def test_a_report_reads_back_from_its_json() -> None:
    leaf = _leaf(1, cases=2, steps=9, rounds=1, failures=[_failure("INV-05", 0.2)])
    leaf.checks_by_id.update({"INV-05": 9})
    leaf.configs.update({"mha 1L": 2})
    leaf.config_first_s["mha 1L"] = 0.1
    leaf.sample(0.5, force=True)
    merged = merge_reports([leaf, _leaf(0, cases=1)])
    again = report_from_json(merged.as_json())
    assert again.as_json() == merged.as_json()


def test_each_worker_gets_its_lane_and_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --device cuda --workers 2: each worker's campaign runs on the GPU with the spins, on its
    # own seeds (its own process builds its own streams: nothing device-side is shared)
    seen: list[dict[str, Any]] = []

    def fake_campaign(impl: str, **kwargs: Any) -> CampaignReport:
        seen.append(kwargs)
        return CampaignReport(impl, kwargs["profile"], kwargs["seed"], device=kwargs["device"])

    monkeypatch.setattr(workers, "run_campaign", fake_campaign)
    tasks = plan_workers(
        "reference", seed=10, shard=Shard(2, 3), workers=2, seconds=5.0, profile="ci",
        out_dir=str(tmp_path), device="cuda", perturbation=SPINS,
    )  # fmt: skip
    reports = [run_worker(task) for task in tasks]
    assert [(k["seed"], k["seed_stride"]) for k in seen] == [(11, 6), (14, 6)]
    assert {k["device"] for k in seen} == {"cuda"} and {k["perturbation"] for k in seen} == {SPINS}
    assert [(r.worker, r.workers, r.shard) for r in reports] == [(0, 2, "2/3"), (1, 2, "2/3")]


def _messages(task: WorkerTask) -> list[tuple[str, int, Any]]:
    sent: queue.Queue[tuple[str, int, Any]] = queue.Queue()
    run_and_report(task, sent, CampaignSignals(threading.Event(), threading.Event()))
    return [sent.get_nowait() for _ in range(sent.qsize())]


def test_a_worker_reports_its_campaign_or_one_line(tmp_path: Path) -> None:
    (task,) = plan_workers("reference", seed=0, shard=Shard(), workers=1, seconds=1.0,
                           profile="ci", out_dir=str(tmp_path), rounds_max=1)  # fmt: skip
    sent = _messages(task)
    kinds = [kind for kind, _, _ in sent]
    assert (
        kinds[0] == "started"
        and kinds[-1] == "done"
        and set(kinds) <= {"started", "progress", "done"}
    )
    assert isinstance(sent[-1][2], CampaignReport) and sent[-1][2].cases > 0
    # an implementation its process cannot build -> the one line the CLI prints, no report
    unknown = WorkerTask("nope", lane=task.lane, seconds=1.0, profile="ci", out_dir=str(tmp_path))
    assert _messages(unknown)[-1][:2] == ("input_error", 0)
    assert "unknown implementation 'nope'" in _messages(unknown)[-1][2]


def test_a_worker_stops_when_another_found_a_failure(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()  # another worker set it before this one's first round
    (task,) = plan_workers("reference", seed=0, shard=Shard(), workers=1, seconds=60.0,
                           profile="ci", out_dir=str(tmp_path))  # fmt: skip
    report = run_worker(task, signals=CampaignSignals(threading.Event(), stop))
    assert report.rounds == 0 and not report.interrupted
