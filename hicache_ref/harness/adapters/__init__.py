"""Implementations under test, behind one seam (``base.Implementation``)."""

from hicache_ref.harness.adapters.base import (
    CAPABILITIES,
    BuildRequest,
    ControllerLike,
    Implementation,
    supports,
    unsupported_reasons,
)
from hicache_ref.harness.adapters.reference import ReferenceImplementation

__all__ = [
    "CAPABILITIES",
    "BuildRequest",
    "ControllerLike",
    "Implementation",
    "ReferenceImplementation",
    "supports",
    "unsupported_reasons",
]
