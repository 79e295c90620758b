"""The shipped suite, read (and every digest checked) once per test session."""

from __future__ import annotations

import functools

from hicache_ref.vectors.models import SuiteHeader, Vector
from hicache_ref.vectors.suite import read_suite, shipped_suite_path


@functools.cache
def shipped() -> tuple[SuiteHeader, list[Vector]]:
    return read_suite(shipped_suite_path())
