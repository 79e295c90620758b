"""The draft releases' draft pages in L3 (0.5.11 - 0.5.18, issue 27, F27).

Those releases register a draft pool with ``set_draft_kv_pool`` and copy its pages to L3 beside
the KV's through plain ``batch_set`` / ``batch_get`` (``d:<key>`` on 0.5.11 - 0.5.12,
``<key>.draft`` from 0.5.13), best-effort. The gate draws their storage worlds with the draft
pair; the recording backend files those calls as the draft pool's, and INV-37 judges the pages
a prefetch counts.
"""

from __future__ import annotations

from hicache_ref.harness.adapters.base import STORAGE_SIDECAR_CAPABILITY
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_releases import fetch_wheel_tree
from hicache_ref.harness.driver.storage_windows import _batches_begun_before
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.recording_storage import BackendCall, legacy_draft_call

KEY = "77d735ce838418aa151bd96b5b1e78ee63860892e0a95c00fe34178442be9b07"
OTHER = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"


def test_a_draft_releases_draft_keys_are_filed_as_the_draft_pools_pages() -> None:
    # 0.5.11 - 0.5.12 prefix the key, 0.5.13 - 0.5.18 suffix it; both become <key>.draft
    assert legacy_draft_call([f"d:{KEY}", f"d:{OTHER}"]) == (
        "draft",
        (f"{KEY}.draft", f"{OTHER}.draft"),
    )
    assert legacy_draft_call([f"{KEY}.draft"]) == ("draft", (f"{KEY}.draft",))
    # KV keys, a mixed call and an empty one stay KV calls
    assert legacy_draft_call([KEY, OTHER]) == ("", (KEY, OTHER))
    assert legacy_draft_call([KEY, f"{OTHER}.draft"]) == ("", (KEY, f"{OTHER}.draft"))
    assert legacy_draft_call([]) == ("", ())


def test_a_draft_release_draws_storage_worlds_that_carry_its_draft_pair() -> None:
    draft_release = SglangImplementation(fetch_wheel_tree("0.5.13"))
    assert {"draft", "storage", STORAGE_SIDECAR_CAPABILITY} <= draft_release.capabilities
    paired = HarnessConfig(storage_ranks=2, draft_layer_num=2, host_pages=24)
    assert draft_release.refine_config(paired).storage_ranks == 2  # kept: its draft goes to L3
    # 0.5.10 has no draft pool, so no world stores one
    assert STORAGE_SIDECAR_CAPABILITY not in SglangImplementation(fetch_wheel_tree()).capabilities


def test_a_batch_begun_before_the_termination_may_still_read_its_kv_pages() -> None:
    # the draft releases read a batch's draft pages, then its KV pages, and look at termination
    # after both: the KV read of a batch whose draft read ran before the termination is that
    # batch's in-flight read (INV-33); a draft read after the termination excuses nothing
    begun = [
        BackendCall("sidecar_get", (f"{KEY}.draft",), pool="draft"),
        BackendCall("get", (KEY,)),
        BackendCall("sidecar_get", (f"{OTHER}.draft",), pool="draft"),
        BackendCall("get", (OTHER,)),
    ]
    assert _batches_begun_before(begun, [3, 5, 6, 7], terminated=4) == {(KEY,)}
    assert _batches_begun_before(begun, [3, 5, 6, 7], terminated=None) == set()
