"""The harness draws exactly the configurations the pools and the controller accept."""

from __future__ import annotations

import pytest

from hicache_ref.harness.world.config import LEGAL_LAYOUTS, HarnessConfig
from hicache_ref.pools.host_layout import LAYOUTS_BY_IO_BACKEND, MHA_ONLY_LAYOUTS


def test_the_harness_knows_every_layout_the_pools_drive() -> None:
    assert {k: tuple(v) for k, v in LEGAL_LAYOUTS.items()} == {
        k: tuple(v) for k, v in LAYOUTS_BY_IO_BACKEND.items()
    }


@pytest.mark.parametrize("layout", MHA_ONLY_LAYOUTS)
def test_an_mha_only_layout_refuses_other_pools(layout: str) -> None:
    HarnessConfig(pool_kind="mha", layout=layout, io_backend="kernel")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds MHA pools only"):
        HarnessConfig(pool_kind="mla", layout=layout, io_backend="kernel")  # type: ignore[arg-type]
