"""The invariant ids a suite must cover: ``specs/invariant_ids.txt``'s, as the package ships
them (``INVARIANT_IDS``, kept equal to the spec file by ``tests/vectors``)."""

from __future__ import annotations

INVARIANT_IDS = tuple(f"INV-{n:02d}" for n in range(1, 20))


def invariant_ids() -> list[str]:
    return list(INVARIANT_IDS)
