"""SGLang's own controller, loaded from an unpacked tree, driven through the same session.

The trees are built at test time: the 0.5.10 wheel (and 0.5.23 for the L2-engine shape) fetched
with ``pip download --no-deps`` into the cache directory; nothing of upstream is committed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_shapes import is_l2_engine_tree
from hicache_ref.harness.adapters.sglang_tree import (
    CONTROLLER_RELPATH,
    check_tree,
    fetch_wheel_tree,
    fork_tree,
    tree_release,
)
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig


@pytest.fixture(scope="module")
def tree_0510() -> Path:
    return fetch_wheel_tree("0.5.10")


def _round_trip(impl: SglangImplementation, config: HarnessConfig) -> list[str]:
    session = Session(impl.refine_config(config), impl, impl.name)
    steps = [
        Step(rule="prefill", args={"tokens": 2 * config.page_size}),
        *[Step(rule="forward_layer") for _ in range(config.layer_num)],
        Step(rule="write", args={"node": 0}),
        Step(rule="synchronize", args={"stream": "write"}),
        Step(rule="drain_acks"),
        Step(rule="evict_device", args={"node": 0}),
        Step(rule="load", args={"node": 0}),
        Step(rule="start_loading"),
        *[
            Step(rule="forward_read", args={"node": 0, "layer": layer, "draft": False})
            for layer in range(config.layer_num)
        ],
    ]
    outcomes = [session.apply(step).text for step in steps]
    session.finish()  # every byte, slot and ack checked from the harness's own model
    return outcomes


@pytest.mark.parametrize(
    "config",
    [
        HarnessConfig(page_size=4, layer_num=2),
        HarnessConfig(page_size=1, layer_num=3, pool_kind="mla", layout="page_first_direct"),
        HarnessConfig(
            page_size=2, layer_num=2, pool_kind="nsa", io_backend="kernel", layout="page_first"
        ),
    ],
    ids=lambda c: c.describe(),
)
def test_upstream_0510_round_trips_bytes_through_the_harness(
    tree_0510: Path, config: HarnessConfig
) -> None:
    # upstream's write -> ack -> evict -> load -> start_loading -> per-layer reads, on SimDevice
    outcomes = _round_trip(SglangImplementation(tree_0510), config)
    assert "drained 1 write ack(s)" in outcomes[config.layer_num + 3]
    assert outcomes[-1].startswith("read layer")


def test_upstream_producer_slots_come_from_its_layer_counter(tree_0510: Path) -> None:
    # 0.5.10 hard-codes three producer slots; the harness models exactly that many
    impl = SglangImplementation(tree_0510)
    assert impl.refine_config(HarnessConfig(num_counters=5)).num_counters == 3


def test_each_world_gets_its_own_device_module(tree_0510: Path) -> None:
    # the controller file binds device_module at import: two worlds must not share it
    impl = SglangImplementation(tree_0510)
    one = Session(impl.refine_config(HarnessConfig()), impl, "sglang")
    two = Session(impl.refine_config(HarnessConfig()), impl, "sglang")
    module_one = type(one.world.ranks[0].controller).__module__
    assert one.world.device is not two.world.device
    controller_two = two.world.ranks[0].controller
    assert controller_two.write_stream is not one.world.ranks[0].controller.write_stream
    assert module_one == "sglang.srt.managers.cache_controller"


def test_a_tree_says_its_release_and_a_fork_keeps_it(tree_0510: Path, tmp_path: Path) -> None:
    # the release scopes the known findings: a planted-bug copy of 0.5.10 is still 0.5.10
    assert tree_release(tree_0510) == "0.5.10"
    assert tree_release(fetch_wheel_tree("0.5.23")) == "0.5.23"
    patched = tmp_path / "cache_controller.py"
    patched.write_text((tree_0510 / CONTROLLER_RELPATH).read_text())
    assert tree_release(fork_tree(patched)) == "0.5.10"
    assert tree_release(tmp_path) == ""  # a checkout never built has no _version.py


def test_a_folder_without_the_controller_is_one_setup_error(tmp_path: Path) -> None:
    with pytest.raises(HiCacheSetupError, match=r"cache_controller\.py, which is missing"):
        check_tree(tmp_path)
    with pytest.raises(HiCacheSetupError, match="no such folder"):
        check_tree(tmp_path / "missing")


def test_a_controller_that_does_not_compile_names_its_line(tmp_path: Path) -> None:
    broken = tmp_path / "cache_controller.py"
    broken.write_text("def oops(:\n")
    tree = fork_tree(broken)
    with pytest.raises(
        HiCacheSetupError, match=r"cache_controller.py:1: the file does not compile"
    ):
        SglangImplementation(tree)


def test_fork_tree_swaps_only_the_controller_file(tree_0510: Path, tmp_path: Path) -> None:
    # a developer's modified copy: same tree, another cache_controller.py, base left untouched
    original = (tree_0510 / CONTROLLER_RELPATH).read_text()
    patched = tmp_path / "cache_controller.py"
    patched.write_text(original + "\n# patched\n")
    tree = fork_tree(patched)
    assert (tree / CONTROLLER_RELPATH).read_text().endswith("# patched\n")
    assert (tree_0510 / CONTROLLER_RELPATH).read_text() == original


def test_fork_tree_swaps_any_one_file_of_the_tree(tree_0510: Path, tmp_path: Path) -> None:
    # a patched hicache_storage.py: the fork has it, the controller and the base stay as they were
    relpath = Path("sglang/srt/mem_cache/hicache_storage.py")
    original = (tree_0510 / relpath).read_text()
    patched = tmp_path / "hicache_storage.py"
    patched.write_text(original + "\n# patched\n")
    tree = fork_tree(patched, tree_0510, relpath)
    assert (tree / relpath).read_text().endswith("# patched\n")
    assert (tree / CONTROLLER_RELPATH).read_bytes() == (tree_0510 / CONTROLLER_RELPATH).read_bytes()
    assert (tree_0510 / relpath).read_text() == original
    # the same bytes as a controller are another fork; a file the tree lacks is refused
    assert fork_tree(patched, tree_0510) != tree
    with pytest.raises(HiCacheSetupError, match=r"is not a file of the tree"):
        fork_tree(patched, tree_0510, Path("sglang/srt/mem_cache/no_such_file.py"))


def test_upstream_0523_l2_engine_round_trips_through_the_same_session() -> None:
    # 0.5.23: transfers through L2TransferEngine, no evict_device; thin shims adapt the names
    tree = fetch_wheel_tree("0.5.23")
    assert is_l2_engine_tree(tree)
    outcomes = _round_trip(SglangImplementation(tree), HarnessConfig(page_size=4, layer_num=2))
    assert outcomes[-1].startswith("read layer")


def test_a_trace_remembers_its_tree_so_the_replay_line_needs_no_flag(
    tree_0510: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a gate over a developer's tree prints `hicache-fuzz replay TRACE`: the header names the tree
    from hicache_ref.harness.adapters.sglang_tree import SRC_ENV
    from hicache_ref.harness.steps.replay import replay

    monkeypatch.delenv(SRC_ENV, raising=False)
    patched = tmp_path / "cache_controller.py"
    patched.write_text((tree_0510 / CONTROLLER_RELPATH).read_text() + "\n# mine\n")
    tree = fork_tree(patched)
    impl = SglangImplementation(tree)
    session = Session(impl.refine_config(HarnessConfig()), impl, "sglang")
    session.apply(Step(rule="prefill", args={"tokens": 4}))
    trace = session.trace()
    assert trace.header.source == str(tree)
    assert not replay(trace).failed


UPSTREAM_CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "sglang"


UPSTREAM_NOTE = re.compile(r"^(F\d+) (INV-\d+|[A-Z]\w*Error)(?: on (\d+\.\d+\.\d+\S*))?: ")
"""A note starts ``F<n> INV-xx:`` (found on 0.5.10) or ``F<n> INV-xx on 0.5.17:``."""


@pytest.mark.parametrize("path", sorted(UPSTREAM_CORPUS.glob("*.jsonl")), ids=lambda p: p.stem)
def test_upstream_finding_still_reproduces_and_the_reference_passes(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the release the note names (0.5.10 unless it says) fails that way, the reference does not
    from hicache_ref.harness.adapters.sglang_tree import SRC_ENV
    from hicache_ref.harness.steps.replay import replay
    from hicache_ref.harness.steps.trace import Trace

    trace = Trace.read(path)
    found = UPSTREAM_NOTE.match(trace.header.note)
    assert found, f"{path.name}: the note must start 'F<n> INV-xx[ on X.Y.Z]: '"
    _, expected, release = found.groups()
    monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release or "0.5.10")))
    assert replay(trace).signature() == expected
    # the reference has no HostPoolGroup: it replays the same world with its draft pair attached
    config = trace.header.config.model_copy(
        update={"pool_group": "none", "side_device_pages": 0, "storage_swa_window": 0}
    )
    as_pair = Trace(header=trace.header.model_copy(update={"config": config}), steps=trace.steps)
    assert not replay(as_pair, implementation="reference").failed


def test_0523_defers_the_reuse_of_freed_pages_until_the_copies_before_the_free_land() -> None:
    # 0.5.23 hands the allocator each submission's finish event; the allocator's free orders
    # the current stream after them, so pages freed under a queued D2H are reused only after it
    from hicache_ref.harness.world.world import build_world

    impl = SglangImplementation(fetch_wheel_tree("0.5.23"))
    world = build_world(impl.refine_config(HarnessConfig(page_size=4, layer_num=2)), impl)
    rank, device = world.ranks[0], world.device
    controller = rank.controller
    locs = rank.allocator.alloc(8)
    assert locs is not None
    controller.write(locs, node_id=0)  # the D2H is queued on the write stream
    controller.evict_device(locs)  # freed while the D2H still reads them
    reused: list[bool] = []
    device.launch(lambda: reused.append(True), label="reuse", kind="kernel")
    device.advance(device.default_stream, 100)
    assert not reused and controller.write_stream.pending > 0  # the reuse waits for the copy
    device.advance(controller.write_stream, 100)
    device.advance(device.default_stream, 100)
    assert reused
