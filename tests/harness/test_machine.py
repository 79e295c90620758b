"""The stateful suite: the reference controller passes the machine under the selected profile,
with every capability and with CP backups restricted to all-layer writes (no per_layer_write)."""

from __future__ import annotations

from hypothesis.internal.conjecture import providers

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.campaigns.literal_pool import CAMPAIGN_POOL
from hicache_ref.harness.campaigns.machine import machine_for
from hicache_ref.harness.campaigns.profiles import make_settings

ReferenceMachine = machine_for(ReferenceImplementation(), "reference")
ReferenceMachine.TestCase.settings = make_settings()  # HICACHE_PROFILE=ci|dev|campaign

TestReferenceController = ReferenceMachine.TestCase


class ReferenceWithoutPerLayerWrite(ReferenceImplementation):
    """The reference declared without per_layer_write: no early reservations, no layer hooks."""

    name = "reference-without-per-layer-write"
    capabilities = CAPABILITIES - {"storage", "per_layer_write"}


AllLayerMachine = machine_for(ReferenceWithoutPerLayerWrite(), ReferenceWithoutPerLayerWrite.name)
AllLayerMachine.TestCase.settings = make_settings()

TestReferenceWithoutPerLayerWrite = AllLayerMachine.TestCase


def test_the_machines_pytest_runs_draw_with_the_campaign_literal_pool() -> None:
    # the suite's session pin (tests/conftest.py): these TestCase machines draw the same cases
    # whatever other test files this process imported, as a campaign's search does
    assert providers._get_local_constants() is CAMPAIGN_POOL
