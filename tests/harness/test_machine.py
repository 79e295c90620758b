"""The stateful suite: the reference controller passes the machine under the selected profile."""

from __future__ import annotations

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.machine import machine_for
from hicache_ref.harness.profiles import make_settings

ReferenceMachine = machine_for(ReferenceImplementation(), "reference")
ReferenceMachine.TestCase.settings = make_settings()  # HICACHE_PROFILE=ci|dev|campaign

TestReferenceController = ReferenceMachine.TestCase
