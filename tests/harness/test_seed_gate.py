"""The seed fork through the gate: its findings replay, and its other deviations are shown directly.

Two kinds of evidence for ``specs/upstream_findings.md`` (section "The seed through the gate"):

- ``fuzz/corpus/seed/*.jsonl``: minimal traces of findings the tree driver reaches. Each note
  starts with the finding and the failure it must produce (``F20 INV-02: ...``, or an exception
  type such as ``F3 IndexError: ...``); the trace fails that way on the seed and passes on the
  reference.
- ``test_f*``: the seed's controller driven directly through its own methods, for deviations the
  tree never provokes (misuse, bad arguments, internal queues). Each test reads as a story: what
  is called, what a correct controller does, what the seed does.

The seed's controller is the fork's ``cache_controller.py`` as re-indented in
``shared/seeds/`` (see its ``REINDENT_NOTES.md``), run by ``adapters/sglang.py`` on the
simulated device. Without that file every test here skips, saying so.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_ref.harness.adapters.sglang import SeedImplementation
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules.forward import forward_layer, prefill
from hicache_ref.harness.rules.write import write_backup
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import World, build_world

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("HICACHE_SHARED_DIR", REPO.parent / "shared"))  # a worktree: set it
SEED_FILE = SHARED / "seeds" / "cache_controller_seed_reindented.py.txt"
SEED_TRACES = sorted((REPO / "fuzz" / "corpus" / "seed").glob("*.jsonl"))
EXPECTED_FAILURE = re.compile(r"^(F\d+) (INV-\d+|[A-Z][A-Za-z]*Error): ")
KNOWN_PATTERNS: dict[str, tuple[str, str]] = {
    "F1": (
        "INV-09",
        r"write ack drained: host copy of node \d+ draft layer \d+ \S+ rank \d+: "
        r"row \d+ holds an untouched \(zero\) row",
    ),
    "F2": ("INV-09", r"load ack drained: device copy of node \d+ draft layer \d+ "),
    "F3": ("IndexError", r"list index out of range"),
    "F4": ("INV-14", r"ack_write_queue: rank \d+ (has \d+ ack rows but|ack row \d+ carries)"),
    "F7": (
        "INV-09",
        r"write ack drained: host copy of node \d+ draft layer \d+ \S+ rank \d+: "
        r"row \d+ holds node-content",
    ),
    "F8": ("INV-18", r"reset\(\) left producer_index="),
    "F9": (
        "INV-07",
        r"free host slots .*holds node-content .*expected the harness's scribble into a free "
        r"host slot",
    ),
    "F20": (
        "INV-02",
        r"two undrained write acks|write ack for node_id \d+, which has no backup in "
        r"flight",
    ),
}
"""What ``specs/upstream_findings.md`` proposes for the known-findings table: per confirmed
finding, (invariant id or exception type, regular expression over the failure message)."""

pytestmark = pytest.mark.skipif(
    not SEED_FILE.is_file(),
    reason=f"the seed's re-indented controller {SEED_FILE} is absent; nothing to gate",
)


@pytest.fixture(autouse=True)
def _seed_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs the seed from ``shared/seeds/``, whatever the environment says."""
    monkeypatch.setenv("HICACHE_SEED_FILE", str(SEED_FILE))
    monkeypatch.delenv("HICACHE_SGLANG_SRC", raising=False)


def seed_world(**overrides: Any) -> World:
    """A simulated world whose controllers are the seed's (records settle as on a GPU)."""
    fields: dict[str, Any] = {"page_size": 4, "layer_num": 2, "settle_records": True}
    fields.update(overrides)
    implementation = SeedImplementation()
    return build_world(implementation.refine_config(HarnessConfig(**fields)), implementation)


def cp_world(**overrides: Any) -> World:
    """One CP rank (no zero-owned rank), NSA pool, as the seed's CP path requires."""
    return seed_world(pool_kind="nsa", cp_size=1, device_pages=16, host_pages=16, **overrides)


def seed_namespace(world: World) -> dict[str, Any]:
    """The globals of the seed's controller module as executed for this world's device."""
    namespace: dict[str, Any] = type(world.ranks[0].controller).__init__.__globals__
    return namespace


def ack_rows(controller: Any, queue: str = "ack_write_queue") -> list[list[int]]:
    return [list(ack.node_ids) for ack in getattr(controller, queue)]


def run_layer_hooks(world: World, layers: int) -> None:
    """The forward's target layer-end hooks for layers ``0 .. layers-1`` on rank 0."""
    for layer in range(layers):
        world.ranks[0].device_pool.notify_layer_end(layer)


# -- the committed traces --------------------------------------------------------------------


def test_seed_corpus_is_present() -> None:
    assert SEED_TRACES, "fuzz/corpus/seed/ holds the seed's minimal traces"


@pytest.mark.parametrize("path", SEED_TRACES, ids=lambda p: p.stem)
def test_seed_trace_fails_as_its_note_says_and_passes_on_the_reference(path: Path) -> None:
    trace = Trace.read(path)
    match = EXPECTED_FAILURE.match(trace.header.note)
    assert match, f"{path.name}: the note must start with 'F<n> <INV-xx or ErrorType>: '"
    finding, expected = match.groups()
    on_seed = replay(trace, implementation="seed")
    assert on_seed.signature() == expected, f"{finding}: {on_seed.error!r}"
    # Verify the proposed known-finding pattern recognises this failure, and no other one does
    matching = [
        fid
        for fid, (invariant, pattern) in KNOWN_PATTERNS.items()
        if invariant == expected and re.search(pattern, str(on_seed.error))
    ]
    assert matching == [finding], f"{finding}: {on_seed.error} matches {matching}"
    on_reference = replay(trace, implementation="reference")
    assert not on_reference.failed, f"{finding} on the reference: {on_reference.error!r}"


# -- F1-F20 driven directly --------------------------------------------------------------------


def test_f4_ranks_queue_two_nodes_acks_in_opposite_orders() -> None:
    # CP 2, a 3-layer draft: two 1-token nodes reserved early, each owned by a different rank
    world = seed_world(
        pool_kind="nsa", cp_size=2, draft_layer_num=3, device_pages=16, host_pages=16
    )
    tree = TreeDriver(world)  # no step checks: let the queues diverge and look at them
    prefill(tree, 1, early_reserve=True, handle=0)
    prefill(tree, 1, early_reserve=True, handle=1)
    owners = [tree.nodes[h].page_owners for h in (0, 1)]
    assert sorted(owners) == [[0], [1]], owners
    for _ in range(3):
        forward_layer(tree)
    # each rank acks the node it does not own after the target layers, its own after the draft
    rows = [ack_rows(rank.controller) for rank in world.ranks]
    assert rows[0] == rows[1][::-1] and rows[0] != rows[1], rows


def test_f20_catch_up_on_a_zero_owned_rank_leaves_a_fresh_pending_state() -> None:
    world = seed_world(
        pool_kind="nsa", cp_size=2, draft_layer_num=3, device_pages=16, host_pages=16
    )
    tree = TreeDriver(world)
    prefill(tree, 1, early_reserve=False, handle=0)
    for _ in range(3):
        forward_layer(tree)
    # write_backup -> write -> reserve + submit_write_cp_per_layer(catch_up_all_layers=True)
    write_backup(tree, 0)
    node_id = tree.nodes[0].node_id
    zero_owned = 1 - tree.nodes[0].page_owners[0]
    controller = world.ranks[zero_owned].controller
    # the zero-owned rank acked after the target layers, then the draft-only catch-up layer
    # registered a new state that the next forward's layer hooks finish and ack again
    assert ack_rows(controller) == [[node_id]]
    assert node_id in controller.pending_layer_writes
    assert node_id not in world.ranks[1 - zero_owned].controller.pending_layer_writes


def test_f5_reservation_gate_ignores_a_pending_per_layer_write() -> None:
    world = cp_world()
    rank = world.ranks[0]
    controller = rank.controller
    locs = rank.allocator.alloc(8)
    first = controller.reserve_write_cp(locs, node_id=0)
    controller.submit_write_cp_per_layer(first, catch_up_all_layers=False)
    # node 0 has a pending per-layer write and no ack yet: a correct gate refuses this
    second = controller.reserve_write_cp(locs, node_id=0)
    assert not hasattr(second, "reason"), "the seed refused; F5 would be fixed"
    controller.submit_write_cp_all_layer(second)
    run_layer_hooks(world, 2)
    assert ack_rows(controller) == [[0], [0]]  # two acks for one radix registration


def test_f6_draft_host_shortfall_is_reported_as_target_host_capacity() -> None:
    world = cp_world(draft_layer_num=2, draft_host_pages=1)
    rank = world.ranks[0]
    free_before = rank.host_pool.available_size()
    result = rank.controller.reserve_write_cp(rank.allocator.alloc(8), node_id=0)
    # the target host pool had room for both pages; only the 1-page draft host pool is short
    assert free_before >= 8 and rank.host_pool.available_size() == free_before
    assert result.reason == "host_capacity"  # a correct controller says draft_host_capacity


def test_f8_reset_keeps_the_layer_counter_and_the_copies_in_flight() -> None:
    world = seed_world(host_pages=8)
    rank = world.ranks[0]
    controller = rank.controller
    host = controller.write(rank.allocator.alloc(4), node_id=0)
    world.device.run_until_idle()
    controller.load(host, node_id=0)
    assert controller.start_loading() == 0
    controller.write(rank.allocator.alloc(4), node_id=1)  # its D2H is queued, not run
    controller.reset()
    assert controller.ack_write_queue == [] and controller.ack_load_queue == []
    # a correct reset drains the streams and resets the counter; the seed does neither
    assert controller.write_stream.pending > 0
    assert controller.layer_done_counter.producer_index == 0


def test_f9_cancel_after_the_final_layer_drains_nothing() -> None:
    world = cp_world()
    controller = world.ranks[0].controller
    reservation = controller.reserve_write_cp(world.ranks[0].allocator.alloc(8), node_id=0)
    controller.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    run_layer_hooks(world, 2)  # the final layer hook appends the ack and drops the state
    assert ack_rows(controller) == [[0]] and controller.write_stream.pending > 0
    # a rollback now frees the host slots while the D2H still runs: cancel must drain first
    assert controller.cancel_layer_write_state(0) is False
    assert controller.write_stream.pending > 0


def test_f10_producer_slot_reuse_is_guarded_by_an_assert_only() -> None:
    world = seed_world(device_pages=12, host_pages=4)
    rank = world.ranks[0]
    controller = rank.controller
    host = controller.write(rank.allocator.alloc(4), node_id=0)
    world.device.run_until_idle()
    for _ in range(controller.layer_done_counter.num_counters):
        controller.load(host, node_id=0)
        controller.start_loading()  # no load stream progress: every slot stays busy
    controller.load(host, node_id=0)
    # start_loading itself checks nothing; update_producer's bare assert (gone under -O) fires
    with pytest.raises(AssertionError):
        controller.start_loading()


def test_f11_the_write_fence_is_the_current_stream_not_the_forward_stream() -> None:
    world = seed_world(host_pages=8)
    rank = world.ranks[0]
    controller = rank.controller
    device = world.device
    locs = rank.allocator.alloc(4)
    buffers = rank.device_pool.layer_buffers(0)

    def store() -> None:
        for buffer in buffers:
            buffer[locs] = 1.0

    forward = device.Stream("forward")  # overlap scheduling: the forward has its own stream
    with device.stream(forward):
        device.launch(store, label="store layer 0", kind="kernel")
    controller.write(locs, node_id=0)  # issued from the default stream
    device.advance(controller.write_stream, 1_000)
    # the D2H ran and its ack completed while the KV store it must follow is still queued
    assert controller.ack_write_queue[0].finish_event.query()
    assert forward.pending == 1


def test_f12_a_reused_producer_slot_aliases_an_undrained_load_ack() -> None:
    world = seed_world(device_pages=12, host_pages=4)
    rank = world.ranks[0]
    controller = rank.controller
    host = controller.write(rank.allocator.alloc(4), node_id=0)
    world.device.run_until_idle()
    slots = controller.layer_done_counter.num_counters
    for node_id in range(slots + 1):
        controller.load(host, node_id=node_id)
        controller.start_loading()
        world.device.run_until_idle()  # each load lands; its ack is never drained
    acks = controller.ack_load_queue
    assert len(acks) == slots + 1
    assert acks[0].finish_event is acks[slots].finish_event  # node 0's ack now tracks node 5's


def test_f13_merged_write_drops_the_draft_only_node_ids() -> None:
    world = seed_world(draft_layer_num=2, host_pages=8)
    rank = world.ranks[0]
    controller = rank.controller
    module = seed_namespace(world)
    assert rank.draft_host_pool is not None
    controller.write_queue.append(
        module["CacheOperation"](rank.host_pool.alloc(4), rank.allocator.alloc(4), 1)
    )
    controller.draft_write_queue.append(
        module["CacheOperation"](rank.draft_host_pool.alloc(4), rank.allocator.alloc(4), 2)
    )
    controller.start_writing()
    assert ack_rows(controller) == [[1]]  # node 2's draft copy is never acked


def test_f14_on_layer_end_checks_its_source_only_when_a_write_is_pending() -> None:
    world = cp_world()
    controller = world.ranks[0].controller
    controller.on_layer_end(0, source="no-such-pool")  # accepted while nothing is pending
    reservation = controller.reserve_write_cp(world.ranks[0].allocator.alloc(8), node_id=0)
    controller.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    with pytest.raises(ValueError, match="source"):
        controller.on_layer_end(0, source="no-such-pool")


def test_f15_evict_host_frees_slots_a_write_still_copies_into() -> None:
    world = seed_world(host_pages=8)
    rank = world.ranks[0]
    controller = rank.controller
    host = controller.write(rank.allocator.alloc(4), node_id=0)
    assert controller.write_stream.pending > 0  # the D2H has not run
    assert controller.evict_host(host) == 4  # accepted: a correct controller refuses (INV-07)
    assert rank.host_pool.is_page_free(int(host[0]) // 4)


def test_f16_a_refused_layer_submit_leaves_the_node_pending() -> None:
    world = cp_world()
    controller = world.ranks[0].controller
    reservation = controller.reserve_write_cp(world.ranks[0].allocator.alloc(8), node_id=0)
    with pytest.raises(ValueError, match="outside"):
        controller.submit_write_cp_layer(reservation, 99)
    assert 0 in controller.pending_layer_writes  # registered before the layer id was checked


def test_f17_two_all_layer_submits_of_one_node_both_ack() -> None:
    world = cp_world()
    controller = world.ranks[0].controller
    locs = world.ranks[0].allocator.alloc(8)
    first = controller.reserve_write_cp(locs, node_id=0)
    second = controller.reserve_write_cp(locs, node_id=0)  # no ack exists yet: the gate passes
    controller.submit_write_cp_all_layer(first)
    controller.submit_write_cp_all_layer(second)
    assert ack_rows(controller) == [[0], [0]]


def test_f18_plain_load_is_accepted_on_a_cp_controller() -> None:
    world = cp_world()
    controller = world.ranks[0].controller
    host = torch.arange(8, dtype=torch.int64)
    device_indices = controller.load(host, node_id=0)  # a correct controller refuses (load_cp)
    assert device_indices is not None and len(controller.load_queue) == 1


def test_f19_a_refused_constructor_leaves_its_hooks_on_the_device_pool() -> None:
    world = seed_world()
    rank = world.ranks[0]
    module = seed_namespace(world)
    with pytest.raises(ValueError, match="write policy"):
        module["HiCacheController"](
            rank.allocator,
            rank.host_pool,
            4,
            None,
            threading.Event(),
            write_policy="no-such-policy",
            io_backend="direct",
        )
    # the half-built controller's counter replaced the live one, and its layer hook fires
    assert rank.device_pool.layer_transfer_counter is not rank.controller.layer_done_counter
    with pytest.raises(AttributeError, match="pending_layer_writes"):
        rank.device_pool.notify_layer_end(0)


# -- the gate with every written-up finding baselined ------------------------------------------
SEED_GATE_BUDGET = "20s"
SEED_GATE_SEED = 176
"""Round seeds from where the 120 s gate first met F9; a short campaign need not meet it again
(its corpus trace pins its pattern), it must only find nothing the table does not explain."""


def test_bounded_seed_gate_with_every_written_up_finding_baselined_finds_nothing_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the known-findings table keeps up with the harness: a finding the rules newly reach and
    # nobody wrote up fails this test with its replay line
    import json

    from hicache_ref.cli import EXIT_OK, main

    report_path = tmp_path / "gate.json"
    status = main(
        [
            "gate", "--impl", "seed", "--known", "all", "--budget", SEED_GATE_BUDGET,
            "--seed", str(SEED_GATE_SEED), "--out", str(tmp_path), "--json", str(report_path),
            "--no-progress",
        ]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert status == EXIT_OK, stdout
    assert report["cases"] > 0 and not report["failures"], stdout


# -- the fork's storage tier --------------------------------------------------------------------
SGLANG_CORPUS = REPO / "fuzz" / "corpus" / "sglang"
STORAGE_FINDINGS = [
    ("F22", "INV-25", "f22_backend_exception_kills_the_backup_thread.jsonl"),
    ("F23", "INV-24", "f23_reset_leaves_the_old_prefetch_io_thread_alive.jsonl"),
    ("F24", "INV-28", "f24_file_backend_clear_wipes_other_ranks.jsonl"),
    ("F25", "INV-24", "f25_reset_keeps_the_prefetch_occupancy.jsonl"),
    ("F26", "INV-25", "f26_backend_exception_kills_the_prefetch_io_thread.jsonl"),
]


@pytest.mark.parametrize(("finding", "expected", "name"), STORAGE_FINDINGS, ids=lambda v: v)
def test_the_fork_keeps_0_5_10s_storage_threads_and_their_findings(
    finding: str, expected: str, name: str
) -> None:
    # the seed draws storage worlds (its 0.5.10-shaped threads, one loop iteration a step);
    # each storage finding's trace on 0.5.10 fails the same way on the fork, and the table
    # baselines it for the fork too (its tree is the 0.5.10 wheel with the fork's controller)
    from hicache_ref.harness.adapters.sglang_tree import tree_release
    from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS, match_known_finding

    implementation = SeedImplementation()
    assert "storage" in implementation.capabilities
    on_seed = replay(Trace.read(SGLANG_CORPUS / name), implementation="seed")
    assert on_seed.signature() == expected, f"{finding}: {on_seed.error!r}"
    release = tree_release(implementation.tree)
    found = match_known_finding(
        tuple(KNOWN_FINDINGS.values()), "seed", expected, str(on_seed.error), release
    )
    assert found is not None and found.id == finding, (release, on_seed.error)
