"""The stateful suite: the reference controller passes the machine under the selected profile,
with every capability and with CP backups restricted to all-layer writes (no per_layer_write)."""

from __future__ import annotations

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.adapters.base import CAPABILITIES
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
