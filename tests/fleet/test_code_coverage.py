"""Coverage of the implementation under test: which files count, and when each line and branch
was first covered.

The code under test is what the run drives: the reference's controller and pools, a mutant's
own file beside them, the controller file of an sglang tree (and what else of the tree runs),
an outside package's folder. The probe stamps each newly covered line and branch with the time
of the sample that first saw it; statements that ran at import count from 0 s.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hicache_ref.campaign.coverage import (
    PACKAGE_ROOT,
    CoverageProbe,
    get_code_under_test,
    measure_coverage,
)
from hicache_ref.cli import main
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree

MODULE = '''\
class Outside:
    """An implementation from another package."""

    def pick(self, flag):
        if flag:
            return "yes"
        return "no"
'''


def test_the_reference_counts_its_controller_and_pools() -> None:
    code = get_code_under_test(get_implementation("reference"))
    assert code.folders == (PACKAGE_ROOT / "controller", PACKAGE_ROOT / "pools")
    names = {code.get_name(str(path)) for path in code.get_files()}
    assert "hicache_ref/controller/cache_controller.py" in names
    assert "hicache_ref/pools/host_pool.py" in names
    assert not any(name.startswith("hicache_ref/harness") for name in names)


def test_a_mutant_counts_its_own_file_beside_the_reference() -> None:
    code = get_code_under_test(get_implementation("mutant:skip_load_fence"))
    names = {code.get_name(str(path)) for path in code.get_files()}
    assert "fuzz/mutants/skip_load_fence.py" in names
    assert "hicache_ref/controller/cache_controller.py" in names


def test_a_tree_counts_its_controller_file_and_what_else_of_it_runs(tmp_path: Path) -> None:
    class FromTree:
        source_tree = str(tmp_path)

    code = get_code_under_test(FromTree())
    controller = tmp_path.resolve() / "sglang/srt/managers/cache_controller.py"
    assert code.get_files() == [controller]  # not the thousands of other files of sglang
    assert code.ran_in == (tmp_path.resolve() / "sglang",)
    assert code.get_name(str(controller)) == "sglang/srt/managers/cache_controller.py"


def _outside_module(tmp_path: Path) -> ModuleType:
    folder = tmp_path / "outside_pkg"
    folder.mkdir()
    (folder / "impl.py").write_text(MODULE)
    spec = importlib.util.spec_from_file_location("outside_pkg_impl", folder / "impl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_probe_stamps_each_line_and_branch_when_first_covered(tmp_path: Path) -> None:
    module = _outside_module(tmp_path)
    outside = module.Outside()
    code = get_code_under_test(outside)
    assert code.folders == ((tmp_path / "outside_pkg").resolve(),)
    name = "outside_pkg/impl.py"
    with measure_coverage(outside, enabled=True) as probe:
        assert isinstance(probe, CoverageProbe)
        # the class and def lines ran at import, before the tracer: covered from 0 s
        assert probe.files[name].lines_first_s == {1: 0.0, 4: 0.0}
        assert outside.pick(True) == "yes"
        assert probe.sample(1.0) == {"lines": 4, "branches": 1}
        assert outside.pick(False) == "no"
        assert probe.sample(2.0) == {"lines": 5, "branches": 2}
        # after a case, a sample only when the last is older than a tenth of the time so far
        outside.pick(True)
        probe.on_case(2.1)
        assert probe.sampled_s == 2.0
        probe.on_case(2.3)
        assert probe.sampled_s == 2.3
    seen = probe.as_json()["files"][name]
    assert (seen["statements"], seen["branches"]) == (5, 2)
    assert seen["lines"] == {"1": 0.0, "4": 0.0, "5": 1.0, "6": 1.0, "7": 2.0}
    assert seen["arcs"] == {"5>6": 1.0, "5>7": 2.0}


def test_without_coverage_no_probe_runs() -> None:
    with measure_coverage(object(), enabled=False) as probe:
        assert probe is None


def test_the_gate_on_sglang_measures_upstreams_controller_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the 0.5.10 wheel's tree (fetched once by setup; a failed fetch fails, never skips)
    monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree()))
    out = tmp_path / "gate.json"
    argv = ["gate", "--impl", "sglang", "--budget", "1.5", "--workers", "1", "--no-progress"]
    assert main([*argv, "--coverage", "--out", str(tmp_path), "--json", str(out)]) == 0
    files = json.loads(out.read_text())["coverage"]["files"]
    controller = files["sglang/srt/managers/cache_controller.py"]
    ran = [t for t in controller["lines"].values() if t > 0]  # past what ran at import
    assert ran and controller["arcs"]
    assert not any(name.startswith("hicache_ref/") for name in files)  # not the reference's
