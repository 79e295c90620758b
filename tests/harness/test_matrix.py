"""The release matrix: releases by name, ranges against the registry's list, shapes, one table.

The three releases gated here at a small budget are one per copy engine (0.5.10: the
controller's own streams; 0.5.19: the first ``L2TransferEngine``; 0.5.23: the ``*_physical``
engine). Their wheels are fetched with pip on first use, like 0.5.10's for the other gate tests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from hicache_ref.campaign.matrix import ReleaseRow, mark_transitions, render_matrix
from hicache_ref.campaign.release_coverage import drove, not_driven
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.cli import EXIT_USAGE, main
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters import sglang_releases
from hicache_ref.harness.adapters.sglang_releases import (
    check_version,
    registry_versions,
    resolve_releases,
)
from hicache_ref.harness.adapters.sglang_shapes import detect_shape
from hicache_ref.harness.adapters.sglang_tree import CACHE_ENV, CONTROLLER_RELPATH, SRC_ENV

LISTED = ["0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13"]
MATRIX_BUDGET = "3s"
ENGINE_RELEASES = ("0.5.10", "0.5.19", "0.5.23")


# -- releases by name -------------------------------------------------------------------------
def test_a_range_takes_every_release_between_its_ends_post_releases_included() -> None:
    assert resolve_releases("0.5.10..0.5.12.post1", LISTED) == [
        "0.5.10",
        "0.5.10.post1",
        "0.5.11",
        "0.5.12",
        "0.5.12.post1",
    ]


def test_a_comma_list_is_gated_as_given() -> None:
    assert resolve_releases("0.5.23,0.5.10", LISTED) == ["0.5.23", "0.5.10"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0.5.x..0.5.12", "not a release number"),
        ("0.5.13..0.5.10", "comes after"),
        ("0.6.0..0.6.9", "no release between"),
        ("0.5.20rc1", "not a release number"),
    ],
)
def test_a_bad_range_is_one_line_naming_the_fix(spec: str, message: str) -> None:
    with pytest.raises(HiCacheInputError, match=message):
        resolve_releases(spec, LISTED)


def test_a_version_is_a_final_or_post_release() -> None:
    assert check_version(" 0.5.15.post1 ") == "0.5.15.post1"
    with pytest.raises(HiCacheInputError, match="--sglang-src DIR"):
        check_version("main")


def test_the_version_list_is_cached_and_offline_falls_back_to_the_cached_trees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    for name in ("sglang-0.5.12", "sglang-0.5.10", "sglang-0.5.10-fork-abc"):
        (tmp_path / name / CONTROLLER_RELPATH).parent.mkdir(parents=True)
        (tmp_path / name / CONTROLLER_RELPATH).write_text("")
    # offline, nothing fetched before: the releases whose trees are cached (forks left out)
    monkeypatch.setattr(sglang_releases, "_query_registry", lambda: None)
    assert registry_versions() == (["0.5.10", "0.5.12"], "cached trees (offline)")
    # online: the registry's list is kept, and read back without a query the next time
    monkeypatch.setattr(sglang_releases, "_query_registry", lambda: ["0.5.10", "0.5.11"])
    assert registry_versions() == (["0.5.10", "0.5.11"], "registry")
    monkeypatch.setattr(sglang_releases, "_query_registry", lambda: pytest.fail("queried"))
    assert registry_versions() == (["0.5.10", "0.5.11"], "registry (cached)")


# -- shapes -----------------------------------------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for relpath, text in files.items():
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / relpath).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "label"),
    [
        ({str(CONTROLLER_RELPATH): "def evict_device(self):"}, "streams"),
        (
            {
                str(CONTROLLER_RELPATH): "def set_draft_kv_pool(self, d, h):",
                "sglang/srt/mem_cache/l2_transfer.py": "load_to_device_per_layer(",
            },
            "l2-v1+draft",
        ),
        (
            {
                str(CONTROLLER_RELPATH): "self.load_fence_stream = None\n"
                "self.write_fence_stream = None\nx.set_hicache_transfer_done_event(k, e)",
                "sglang/srt/mem_cache/l2_transfer.py": "load_to_device_per_layer_physical(",
            },
            "l2-v2+done_event+load_fence+write_fence",
        ),
    ],
    ids=["streams", "l2-v1", "l2-v2"],
)
def test_the_shape_is_read_from_the_tree_not_its_version(
    tmp_path: Path, files: dict[str, str], label: str
) -> None:
    assert detect_shape(_tree(tmp_path, files)).label == label


# -- the table --------------------------------------------------------------------------------
def test_the_table_names_a_finding_where_it_appears_and_where_it_goes() -> None:
    rows = [
        ReleaseRow("0.5.10", "streams", 9, known_hits={"F8": 2}),
        ReleaseRow("0.5.11", "streams+draft", refused="no tree"),
        ReleaseRow(
            "0.5.12",
            "streams+draft",
            9,
            known_hits={"F8": 1},
            new_failures=[{"invariant": "INV-11", "error": "e", "trace": "t.jsonl"}],
        ),
        ReleaseRow("0.5.13", "streams+draft", 9),
    ]
    mark_transitions(rows)
    # the refused release says nothing: 0.5.12 is compared with 0.5.10
    assert (rows[2].appeared, rows[2].disappeared) == (["NEW INV-11"], [])
    assert (rows[3].appeared, rows[3].disappeared) == ([], ["F8", "NEW INV-11"])
    table = render_matrix(rows)
    assert "refused: no tree" in table and "+NEW INV-11" in table and "-F8" in table
    assert "0.5.12: hicache-fuzz replay t.jsonl" in table
    assert table.endswith("matrix: FAILED: 2 of 4 release(s) passed their gate")


def test_a_release_part_no_world_drives_is_named_with_its_reason(tmp_path: Path) -> None:
    mem = tmp_path / "sglang/srt/mem_cache"
    (mem / "pool_host").mkdir(parents=True)
    (mem / "buffer_mode").mkdir()
    (mem / "hicache_storage.py").write_text("")
    (mem / "pool_host" / "group.py").write_text("class HostPoolGroup: ...\n")
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert set(parts) == {"side pools", "buffer mode"}  # storage is driven here
    assert "issue 27" in parts["buffer mode"]
    assert "side pools" not in dict(not_driven(tmp_path, {"storage", "pool_group:swa"}))
    # buffer mode is driven where the tree's beliefs are (0.5.19+: the capability)
    assert "buffer mode" not in dict(not_driven(tmp_path, {"storage", "storage:buffer_only"}))
    assert "capability storage:buffer_only" in parts["buffer mode"]
    row = ReleaseRow("0.5.99", "x", 3, drove=["group swa 12%"], not_driven=list(parts.items()))
    table = render_matrix([row])
    assert "group swa 12%" in table and "0.5.99: not driven: buffer mode: " in table


def test_a_row_says_what_share_of_its_cases_ran_in_buffer_mode() -> None:
    report = CampaignReport("sglang", "ci", 0, cases=8)
    report.features["storage mode"].update({"buffer_only": 2, "cache": 3, "no storage": 3})
    assert "buffer mode 25%" in drove(report)
    report.features["storage mode"] = Counter({"cache": 5, "no storage": 3})
    assert not any(part.startswith("buffer mode") for part in drove(report))


def test_a_hybrid_controller_before_pool_groups_is_named_as_the_mamba_cache_it_serves(
    tmp_path: Path,
) -> None:
    # 0.5.10 - 0.5.18 ship a HybridCacheController with write_storage for the Mamba radix
    # cache alone; only 0.5.19+'s (the one that packs draft pools) stores a pool group
    hybrid = tmp_path / "sglang/srt/mem_cache/hybrid_cache"
    hybrid.mkdir(parents=True)
    (hybrid.parent / "hicache_storage.py").write_text("")
    (hybrid.parent / "memory_pool_host.py").write_text("class MambaPoolHost: ...\n")
    controller = hybrid / "hybrid_cache_controller.py"
    controller.write_text("class HybridCacheController:\n    def write_storage(self): ...\n")
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert set(parts) == {"mamba side pool"}
    assert "before 0.5.19" in parts["mamba side pool"]
    controller.write_text(controller.read_text() + "    packed_draft_device_pools = ()\n")
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert set(parts) == {"mamba side pool", "storage sidecars in pool groups"}
    assert "storage sidecars in pool groups" not in dict(
        not_driven(tmp_path, {"storage", "storage:sidecar", "pool_group:sidecar"})
    )


def test_a_mamba_state_pool_and_its_l3_page_are_driven_where_their_capabilities_are_granted(
    tmp_path: Path,
) -> None:
    # 0.5.19+'s pool-group controller with a Mamba host pool: the state pool is drawn where the
    # gate grants pool_group:mamba, its L3 page where it grants storage:mamba too
    mem = tmp_path / "sglang/srt/mem_cache"
    (mem / "hybrid_cache").mkdir(parents=True)
    (mem / "pool_host").mkdir()
    (mem / "hicache_storage.py").write_text("")
    (mem / "pool_host" / "mamba.py").write_text("class MambaPoolHost: ...\n")
    (mem / "hybrid_cache" / "hybrid_cache_controller.py").write_text(
        "class HybridCacheController:\n    def _page_transfer_sidecar(self): ...\n"
    )
    granted = {"storage", "storage:swa", "pool_group:swa"}
    parts = dict(not_driven(tmp_path, granted))
    assert set(parts) == {"mamba side pool", "mamba storage"}
    assert "pool_group:mamba" in parts["mamba side pool"]
    parts = dict(not_driven(tmp_path, granted | {"pool_group:mamba"}))
    assert set(parts) == {"mamba storage"}
    assert "storage:mamba" in parts["mamba storage"]
    assert not_driven(tmp_path, granted | {"pool_group:mamba", "storage:mamba"}) == []


def test_an_independent_pool_window_in_l3_is_driven_only_where_storage_swa_is_granted(
    tmp_path: Path,
) -> None:
    # 0.5.19+'s hybrid controller reads an SWA side pool's L3 window after the KV pages
    # (_page_transfer_sidecar): driven where the gate draws SWA storage worlds, named elsewhere
    hybrid = tmp_path / "sglang/srt/mem_cache/hybrid_cache"
    hybrid.mkdir(parents=True)
    (hybrid.parent / "hicache_storage.py").write_text("")
    (hybrid / "hybrid_cache_controller.py").write_text(
        "class HybridCacheController:\n    def _page_transfer_sidecar(self): ...\n"
    )
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert set(parts) == {"independent-pool storage"}
    assert "storage:swa" in parts["independent-pool storage"]
    assert not_driven(tmp_path, {"storage", "storage:swa", "pool_group:swa"}) == []


def test_pp_tickets_are_driven_only_where_the_pp_gate_runs(tmp_path: Path) -> None:
    # 0.5.21+'s hybrid controller has a PP ticket thread; the matrix runs the PP gate only on a
    # tree granted storage:pp (0.5.21+ whose hybrid controller loads): elsewhere it is named
    hybrid = tmp_path / "sglang/srt/mem_cache/hybrid_cache"
    hybrid.mkdir(parents=True)
    (hybrid.parent / "hicache_storage.py").write_text("")
    (hybrid / "hybrid_cache_controller.py").write_text(
        "class HybridCacheController:\n    def pp_prefetch_command_thread_func(self): ...\n"
    )
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert set(parts) == {"pp prefetch"} and "was not granted" in parts["pp prefetch"]
    assert not_driven(tmp_path, {"storage", "storage:pp"}) == []


def test_pp_parts_the_pp_gate_draws_only_where_granted_are_named_elsewhere(tmp_path: Path) -> None:
    # 0.5.21+'s tickets carry pool specs (an independent side pool's only on a tree with an SWA
    # window or a Mamba state in L3 too, storage:swa or storage:mamba), and 0.5.20+'s unified
    # radix cache lets PP rank 0 decide the timeout verdict (only without a ticket, which the PP
    # gate polls in every PP world: driver/pp_verdict.py)
    hybrid = tmp_path / "sglang/srt/mem_cache/hybrid_cache"
    hybrid.mkdir(parents=True)
    (hybrid.parent / "hicache_storage.py").write_text("")
    (hybrid / "hybrid_cache_controller.py").write_text(
        "class HybridCacheController:\n    def pp_prefetch_command_thread_func(self): ...\n"
        "    pool_specs = ()\n"
    )
    (hybrid.parent / "unified_radix_cache.py").write_text("# Wall clocks differ: PP0 decides\n")
    parts = dict(not_driven(tmp_path, {"storage"}))
    assert {"pp prefetch", "pp independent-pool tickets", "pp timeout verdict"} <= set(parts)
    assert "without a PP ticket" in parts["pp timeout verdict"]
    parts = dict(not_driven(tmp_path, {"storage", "storage:pp"}))
    assert set(parts) == {"pp independent-pool tickets"}
    assert "independent side pool" in parts["pp independent-pool tickets"]
    # with an SWA side pool or a Mamba state in L3 too, the PP gate draws the independent
    # pool's tickets (pp_gate.pp_worlds)
    for window in ("storage:swa", "storage:mamba"):
        assert not_driven(tmp_path, {"storage", "storage:pp", window}) == [], window


# -- the command line -------------------------------------------------------------------------
def test_matrix_gates_one_release_per_engine_at_a_small_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the CI cut of `gate --matrix`: every engine shape adapted, none refused
    monkeypatch.delenv(SRC_ENV, raising=False)
    report = tmp_path / "matrix.json"
    status = main(
        [
            "gate", "--impl", "sglang", "--matrix", ",".join(ENGINE_RELEASES),
            "--budget-each", MATRIX_BUDGET, "--out", str(tmp_path), "--json", str(report),
            "--no-progress",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    rows = json.loads(report.read_text())["releases"]
    assert status == 0, out
    assert [row["release"] for row in rows] == list(ENGINE_RELEASES)
    assert [row["shape"].split("+")[0] for row in rows] == ["streams", "l2-v1", "l2-v2"]
    assert all(row["cases"] > 0 and row["refused"] is None for row in rows), out
    # what each release has that no world drove is named with its reason, never left silent
    assert "storage" not in rows[2]["not_driven"]
    # 0.5.23 draws buffer_only storage worlds (how many: the row's drove, which a 3 s gate
    # may leave without one)
    assert "buffer mode" not in rows[2]["not_driven"], out
    assert "side pools" not in rows[2]["not_driven"]  # 0.5.23 draws pool_group="swa"
    assert "independent-pool storage" not in rows[2]["not_driven"]  # ... in storage worlds too
    assert "mamba side pool" not in rows[2]["not_driven"]  # ... and pool_group="mamba"
    assert "mamba storage" not in rows[2]["not_driven"]  # ... with its L3 page too
    # storage on every release: 0.5.19 keys its pages with utils.py's get_hash_str
    assert all("storage" not in row["not_driven"] for row in rows), out
    # ... and so does 0.5.19 (its flat beliefs); 0.5.10 has no buffer mode to drive
    assert all("buffer mode" not in row["not_driven"] for row in rows), out
    # 0.5.23's PP tickets: the matrix ran the PP gate on it, and only on it
    assert "pp prefetch" not in rows[2]["not_driven"], out
    assert "pp independent-pool tickets" not in rows[2]["not_driven"], out  # its SWA worlds
    assert any(part.startswith("pp tickets ") for part in rows[2]["drove"]), out
    assert not any(part.startswith("pp tickets ") for row in rows[:2] for part in row["drove"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gate", "--impl", "sglang", "--sglang-version", "latest"], "not a release number"),
        (["gate", "--impl", "reference", "--matrix", "0.5.10..0.5.11"], "--impl sglang"),
        (
            ["gate", "--impl", "sglang", "--matrix", "0.5.10", "--sglang-version", "0.5.10"],
            "names the releases itself",
        ),
        (["setup", "--version", "0.5"], "not a release number"),
    ],
)
def test_a_bad_release_argument_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
