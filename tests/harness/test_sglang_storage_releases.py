"""Upstream's storage threads on every release 0.5.10 - 0.5.23, each under its own protocol.

The prefetch protocol changed twice between 0.5.10 and 0.5.19, and the gate reads which one a
release has from its controller class (``sglang_storage.prefetch_protocol``), never from its
version: 0.5.10 - 0.5.15 take the host pages of the whole prefetch up front and the tree polls
the operation (``poll``); 0.5.16 - 0.5.18 hand the agreed hit back on ``prefetch_hit_queue`` so
the tree allocates a bounce buffer of exactly the hit, and still poll (``hit-poll``); 0.5.19+
publish PrefetchAcks (``ack``). Every release keys its pages with its own hash: 0.5.10's
``hicache_storage.get_hash_str``, 0.5.11 - 0.5.19's ``utils.get_hash_str`` chained page by page,
0.5.20+'s ``get_storage_hash_str``. The stories below back a chain up and prefetch it back on a
release of each protocol, through upstream's own threads, with the harness's checks after each
step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_storage import (
    PROTOCOL_ACK,
    PROTOCOL_HIT_POLL,
    PROTOCOL_POLL,
    prefetch_protocol,
)
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree
from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS, match_known_finding
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig

PROTOCOL_OF = {
    "0.5.10": PROTOCOL_POLL,
    "0.5.13": PROTOCOL_POLL,
    "0.5.17": PROTOCOL_HIT_POLL,
    "0.5.18": PROTOCOL_HIT_POLL,
    "0.5.19": PROTOCOL_ACK,
}


def apply(session: Session, rule: str, **args: Any) -> str:
    outcome = session.apply(Step(rule=rule, args=args))
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def storage_session(release: str, ranks: int = 2) -> tuple[SglangImplementation, Session]:
    impl = SglangImplementation(fetch_wheel_tree(release))
    config = impl.refine_config(
        HarnessConfig(page_size=4, host_pages=32, storage_ranks=ranks, storage_batch_pages=1)
    )
    return impl, Session(config, impl, "sglang")


@pytest.mark.parametrize("release", sorted(PROTOCOL_OF))
def test_each_release_has_storage_and_the_protocol_its_controller_class_says(
    release: str,
) -> None:
    impl, session = storage_session(release, ranks=1)
    assert "storage" in impl.capabilities
    storage = session.storage
    assert storage is not None
    tier: Any = storage.l3.tiers[0]
    (upstream_class,) = type(storage.l3.ranks[0].controller).__bases__  # the tree's own class
    assert prefetch_protocol(upstream_class) == PROTOCOL_OF[release]
    assert tier.protocol == PROTOCOL_OF[release]
    assert (storage.polled is not None) == (PROTOCOL_OF[release] != PROTOCOL_ACK)
    session.finish()


def test_0_5_17_allocates_the_bounce_buffer_at_the_hit_and_settles_by_polling() -> None:
    _, session = storage_session("0.5.17")
    storage = session.storage
    assert storage is not None and storage.polled is not None and not storage.up_front
    # a two-page chain goes to L3 through the backup thread on both ranks
    apply(session, "write_storage", pick=1, new=True)
    assert apply(session, "storage_step", kind="backup") == "backup step: [8, 8]"
    apply(session, "drain_backup_acks")
    # the prefetch takes no host pages: only the hit, reduced over the ranks' own gloo group,
    # earns a bounce buffer, given by the tree's drain
    free_before = [r.host_pool.available_size() for r in storage.l3.ranks]
    apply(session, "prefetch", pick=0)
    assert [r.host_pool.available_size() for r in storage.l3.ranks] == free_before
    assert apply(session, "storage_step", kind="hit_query") == "hit_query step: [8, 8]"
    assert apply(session, "drain_prefetch_acks") == "drained 0 revoke(s), 1 hit(s)"
    assert [r.host_pool.available_size() for r in storage.l3.ranks] == [f - 8 for f in free_before]
    # the IO fills the buffer; the tree reads completed_tokens off the operation, agrees on the
    # MIN over ranks and inserts the fetched chain (the checks judge the bytes that landed)
    assert apply(session, "storage_step", kind="io") == "io step: [8, 8]"
    (rid,) = storage.ongoing()
    assert apply(session, "check_prefetch", request=rid).endswith("settled")
    assert not storage.ongoing()
    apply(session, "detach_storage")
    assert all(not tier.alive_threads() for tier in storage.l3.tiers)
    session.finish()


def test_0_5_18_revokes_a_below_threshold_hit_at_the_drain_without_a_revoke_queue() -> None:
    _, session = storage_session("0.5.18", ranks=1)
    storage = session.storage
    assert storage is not None
    controller: Any = storage.l3.ranks[0].controller
    assert not hasattr(controller, "prefetch_revoke_queue")  # 0.5.18's thread revokes nothing
    controller.prefetch_threshold = 64  # more than any chain the harness backs up
    apply(session, "write_storage", pick=1, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    controller.prefetch_threshold = 4
    apply(session, "prefetch", pick=0)
    controller.prefetch_threshold = 64  # the hit comes back below it: revoked at the drain
    apply(session, "storage_step", kind="hit_query")
    assert apply(session, "drain_prefetch_acks") == "drained 0 revoke(s), 1 hit(s)"
    assert not storage.ongoing()
    session.finish()


CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "sglang"


@pytest.mark.parametrize(
    ("name", "fails_on", "passes_on"),
    [
        # F23's IO thread, parked inside its body at the reset, runs again in the next epoch
        ("f23_reset_leaves_the_parked_io_thread_running.jsonl", ("0.5.15",), ("0.5.19",)),
        # ... or finishes its body and releases bounce pages the reset already took back
        ("f23_reset_leaves_the_io_release_to_the_next_epoch.jsonl", ("0.5.17",), ("0.5.19",)),
        # F25: 0.5.13.post1's reset() is 0.5.13's; 0.5.14 zeroes the occupancy
        ("f25_reset_keeps_the_prefetch_occupancy.jsonl", ("0.5.13.post1",), ("0.5.14",)),
        # F27 (INV-37) on the draft releases with the prefetch allocated up front (0.5.19+ and 0.5.10
        # have no draft pair to replay it on; the reference passes it, test_sglang_adapter)
        (
            "f27_draft_page_read_best_effort_counts_the_kv_page.jsonl",
            ("0.5.11", "0.5.12", "0.5.13", "0.5.14"),
            (),
        ),
        # ... and with the bounce buffer given at the hit, a drawn hole on one draft read
        ("f27_draft_page_hole_at_the_hit_counts_the_kv_page.jsonl", ("0.5.16", "0.5.18"), ()),
    ],
    ids=["F23-parked-io", "F23-late-release", "F25-post1", "F27-up-front", "F27-at-the-hit"],
)
def test_a_finding_seen_first_in_the_matrix_is_baselined_only_in_its_releases(
    name: str, fails_on: tuple[str, ...], passes_on: tuple[str, ...], monkeypatch: Any
) -> None:
    trace = Trace.read(CORPUS / name)
    finding = KNOWN_FINDINGS[trace.header.note.split()[0]]
    known = tuple(KNOWN_FINDINGS.values())
    for release in fails_on:
        monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release)))
        result = replay(trace)
        assert result.failed, release
        found = match_known_finding(known, "sglang", result.signature(), str(result.error), release)
        assert found is not None and found.id == finding.id, (release, result.error)
        assert (
            match_known_finding(known, "sglang", result.signature(), str(result.error), "0.5.19")
            is None
        )
    for release in passes_on:
        monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release)))
        assert not replay(trace).failed, release
