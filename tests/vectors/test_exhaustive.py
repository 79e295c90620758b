"""The exhaustive storage checker's nearest misses, shipped as vectors: for each window, the
shortest two-rank interleaving that breaks it under the oracle's planted bug (searched as the
harness grants), recorded on the reference, passes the reference and fails the catalogue's
mutant of the same bug with the id it guards."""

from __future__ import annotations

import pytest

from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.vectors.replay import replay_vector
from hicache_ref.vectors.stories_exhaustive import EXHAUSTIVE_WORLDS
from tests.vectors.conftest import shipped

MUTANT_OF: dict[str, str | None] = {
    "backup_ack_before_write": "backup_acks_before_write",
    "backup_skips_failed_batch": "backup_skips_failed_batch",
    "io_ignores_termination": "io_ignores_termination",
    "io_counts_past_hole": "io_counts_past_hole",
    "io_raise_skips_final_ack": "io_exception_doubles_final_ack",
    "reset_keeps_old_thread": "reset_forgets_parked_threads",
    "terminate_releases_tail": "terminate_releases_tail",
    "reset_keeps_release_queue": "reset_keeps_release_queue",
    "progress_not_reduced": "progress_not_reduced",
    "hit_sync_per_batch": "hit_sync_per_batch",
    "clear_wipes_every_namespace": "keys_without_rank",
    "detach_with_work_in_flight": None,
}
"""The oracle's planted bug -> the catalogue mutant of the same window on the reference's tier
(None: the catalogue has none; ``keys_without_rank`` shares a namespace, as a clear that wipes
every rank's does)."""


def test_every_window_world_has_a_vector_and_a_mutant() -> None:
    ids = {v.id for v in shipped()[1]}
    assert sorted(MUTANT_OF) == sorted(EXHAUSTIVE_WORLDS)
    assert all(f"story-exhaustive-{flag.replace('_', '-')}" in ids for flag in EXHAUSTIVE_WORLDS)


@pytest.mark.parametrize("flag", sorted(EXHAUSTIVE_WORLDS))
def test_the_nearest_miss_passes_the_reference_and_fails_the_mutant(flag: str) -> None:
    vector_id = f"story-exhaustive-{flag.replace('_', '-')}"
    vector = next(v for v in shipped()[1] if v.id == vector_id)
    assert replay_vector(vector, get_implementation("reference"), "reference").status == "pass"
    name = MUTANT_OF[flag]
    if name is None:
        return
    mutant = get_implementation(f"mutant:{name}")
    mutant.focus = None  # type: ignore[attr-defined]  # the vector's own world, not the focus
    result = replay_vector(vector, mutant, name)
    assert (result.status, result.invariant) == ("fail", EXHAUSTIVE_WORLDS[flag][0]), (
        result.render()
    )
