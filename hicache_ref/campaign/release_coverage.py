"""What a release's gate drove, and what the release has that the gate does not drive.

The release matrix (``matrix.py``) reads a finding's absence as a fix only where the gate drove
the code the finding lives in. So each row says what ran (``drove``: the pool-group worlds
drawn, storage, the forward on its own stream, from the campaign's own counts) and what the
release's tree has that no world drives (``not_driven``: one reason each, read from the tree's
files, never from a finding's absence):

- ``features_of``: the tree's parts that matter to the gate, each detected by a file or a name
  in it (the storage threads, the ``HostPoolGroup``, its SWA and Mamba side pools, the draft
  releases' draft L3 copies, the radix caches' shortened prefetch under host pressure, storage
  sidecars in pool groups and of independent pools, a Mamba pool's L3 page, buffer mode, PP
  prefetch (and what of it
  the PP gate draws only where its tree grants it: an independent side pool on a ticket (an
  SWA window, a Mamba state page), the timeout policy's PP-rank-0 verdict on a cache-mode
  prefetch), decode context parallel);
- ``drove``: the campaign report's counts as a short list (``group swa 11%``, ``storage 8%``);
- ``not_driven``: each part the tree has and the implementation's capabilities leave out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hicache_ref.harness.adapters.sglang_storage import SHORTENED_PREFETCH

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport

MEM_CACHE = "sglang/srt/mem_cache"
HYBRID_CONTROLLER = f"{MEM_CACHE}/hybrid_cache/hybrid_cache_controller.py"
CONTROLLER = "sglang/srt/managers/cache_controller.py"
RADIX_CACHES = ("hiradix_cache.py", "unified_radix_cache.py")
PP0_VERDICT = "PP0 decides"
"""What marks 0.5.20+'s unified radix cache's PP-rank-0 timeout verdict (its comment)."""
GROUP_CONTROLLER_MARK = "packed_draft_device_pools"
"""What marks 0.5.19+'s pool-group HybridCacheController (the one before serves Mamba alone)."""

NOT_DRIVEN_REASONS: dict[str, str] = {
    "storage": "its controller lacks one of upstream's storage threads, or its tree no "
    "page-key hash the gate can compute (sglang_storage.supports_storage, sglang_hashes)",
    "side pools": "independent side pools need the hybrid controller's side-pool surface",
    "mamba side pool": "a Mamba state pool (one slot per node) is drawn as pool_group='mamba' "
    "only where the gate loads the tree's pool-group HybridCacheController (capability "
    "pool_group:mamba, 0.5.19+): before 0.5.19 the HybridCacheController serves the Mamba "
    "radix cache alone (its pool transfers and their L3 pages included), which the harness "
    "does not model (issue 27)",
    "draft storage copies": "the draft releases' best-effort draft L3 copies "
    "(_draft_page_set / _draft_page_get, 'd:{key}' then '{key}.draft' keys) run only in "
    "storage worlds with a draft pair, drawn where the gate drives the release's storage "
    "threads and its set_draft_kv_pool (capabilities storage:sidecar and draft)",
    "storage memory-pressure fallback": "the radix cache's cut to the free host pages (0.5.13 "
    "- 0.5.15: the prefetch allocated up front, 0.5.16+: the hit at its bounce buffer) is drawn "
    "as storage_host_pressure only where the gate drives the release's storage threads "
    "(capability storage:host_pressure)",
    "storage sidecars in pool groups": "storage worlds with a pool group need the tree's "
    "HybridCacheController (0.5.19+) with its storage threads: write_storage and prefetch "
    "with the DRAFT sidecar riding on the KV slots (batch_set_v2 / batch_exists_v2 / "
    "batch_get_v2, _page_transfer_kv_batch's min)",
    "independent-pool storage": "an independent side pool's L3 window (_page_transfer_sidecar's "
    "non-KV-derived read, _sync_trailing_keys, TRAILING_PAGES hits and their restorable "
    "prefixes) is drawn in SWA storage worlds only where the gate loads the tree's "
    "HybridCacheController with its storage threads (capability storage:swa, 0.5.19+; "
    "harness/driver/storage_side.py, INV-39)",
    "mamba storage": "a Mamba state pool's L3 page (one TRAILING_PAGES page per node under its "
    "last page key: should_backup's MAMBA rule, _sync_trailing_keys' last hit page, "
    "_page_transfer_sidecar's non-KV-derived read) is drawn in Mamba storage worlds only where "
    "the gate loads the tree's HybridCacheController with its storage threads and the tree's "
    "Mamba component stores its state in L3 (capability storage:mamba, 0.5.19+; "
    "harness/driver/storage_side.py, INV-39); this tree's was not granted (issue 27)",
    "buffer mode": "buffer_only host memory (the controller's buffer-mode capacity and rate "
    "limit under the BufferModePipeline's tree half: write staging freed at the storage ack, "
    "the tree's StorageExistenceCache taught at the ack, healed by the rank-agreed hit query) "
    "is drawn as storage_buffer_only only where the harness drives the tree's beliefs beside "
    "the hybrid controller with host_memory_mode (capability storage:buffer_only, 0.5.19+: "
    "flat beliefs healed from the folded hit through 0.5.21, per-pool ones from "
    "query_pool_hit_pages from 0.5.22; harness/driver/storage_buffer.py, INV-41); this "
    "tree's were not granted (issue 27)",
    "pp prefetch": "the PP command thread serves PPPrefetchState tickets of the hybrid "
    "controller's storage prefetch only in buffer_only mode with a PP group of 2+ ranks "
    "(enable_pp_ticket); the PP gate (harness/campaigns/pp_gate.py, run by the matrix) drives "
    "it on a tree whose hybrid controller the harness loads (storage:pp: 0.5.21 - 0.5.22's "
    "tickets carrying PP rank 0's hit, 0.5.23's queried by every PP rank; the command, IO, "
    "sync and backup threads under schedule points; assume_stored submits; a draft sidecar on "
    "the tickets); this tree's was not granted (issue 27)",
    "pp independent-pool tickets": "a ticket whose pool spec names an independent side pool "
    "(its own slots: num_slots, its keys, TRAILING_PAGES hits, _allocate_pp_prefetch_buffers' "
    "per-pool allocation at the pool's own page size and rollback) is drawn in about a quarter "
    "of the PP gate's worlds each as an SWA window and as a Mamba state page "
    "(harness/driver/pp_side.py, INV-38 and INV-39, pp_gate.pp_worlds) only on a tree with PP "
    "tickets and that pool's window in L3 (capabilities storage:pp and storage:swa or "
    "storage:mamba); this tree's were not granted (issue 27)",
    "pp timeout verdict": "the timeout stop policy's verdict in a PP group "
    "(_can_terminate_prefetch: PP rank 0 decides, _all_reduce hands it along PP) runs only for "
    "a prefetch without a PP ticket (cache mode); the PP gate polls one such prefetch per world "
    "beside its tickets, through the tree's own methods on each rank's clock "
    "(harness/driver/pp_verdict.py, INV-38), only on a tree whose PP worlds it draws "
    "(storage:pp, 0.5.21+); this tree's were not granted (issue 27)",
    "decode context parallel": "DCP lives in upstream's MLA host pool and index translation; "
    "the gate runs this project's pools (issue 27)",
}
"""Why each part a release may have is not driven, when it is not."""


def features_of(tree: Path) -> list[str]:
    """The parts of ``tree`` the gate could drive, in ``NOT_DRIVEN_REASONS`` order."""
    hybrid = tree / HYBRID_CONTROLLER
    hybrid_text = hybrid.read_text(errors="replace") if hybrid.exists() else ""
    found = {
        "storage": (tree / MEM_CACHE / "hicache_storage.py").exists(),
        "side pools": (tree / MEM_CACHE / "pool_host" / "group.py").exists(),
        "draft storage copies": _mentions(tree / CONTROLLER, "def _draft_page_set("),
        "storage memory-pressure fallback": any(
            _mentions(tree / MEM_CACHE / name, SHORTENED_PREFETCH) for name in RADIX_CACHES
        )
        or "def allocate_storage_hit" in hybrid_text,
        "mamba side pool": bool(hybrid_text)
        and (
            (tree / MEM_CACHE / "pool_host/mamba.py").exists()
            or _mentions(tree / MEM_CACHE / "memory_pool_host.py", "class MambaPoolHost")
        ),
        # a HostPoolGroup's storage (0.5.19+: the controller that packs draft pools)
        "storage sidecars in pool groups": "def write_storage" in hybrid_text
        and GROUP_CONTROLLER_MARK in hybrid_text,
        "independent-pool storage": "def _page_transfer_sidecar" in hybrid_text,
        "mamba storage": "def _page_transfer_sidecar" in hybrid_text
        and (tree / MEM_CACHE / "pool_host/mamba.py").exists(),
        "buffer mode": (tree / MEM_CACHE / "buffer_mode").is_dir(),
        "pp prefetch": "pp_prefetch_command_thread_func" in hybrid_text,
        "pp independent-pool tickets": "pool_specs" in hybrid_text,
        "pp timeout verdict": _mentions(tree / MEM_CACHE / "unified_radix_cache.py", PP0_VERDICT),
        "decode context parallel": _mentions(tree / MEM_CACHE / "pool_host" / "mla.py", "dcp_size"),
    }
    return [name for name in NOT_DRIVEN_REASONS if found[name]]


def _mentions(path: Path, name: str) -> bool:
    return path.exists() and name in path.read_text(errors="replace")


def not_driven(tree: Path, capabilities: Collection[str]) -> list[tuple[str, str]]:
    """(part, reason) for every part of ``tree`` that no world of the gate drives."""
    driven = {
        "storage": "storage" in capabilities,
        "side pools": "pool_group:swa" in capabilities,
        "mamba side pool": "pool_group:mamba" in capabilities,
        "storage sidecars in pool groups": {"storage:sidecar", "pool_group:sidecar"}
        <= set(capabilities),
        "storage memory-pressure fallback": "storage:host_pressure" in capabilities,
        "draft storage copies": {"storage:sidecar", "draft"} <= set(capabilities),
        # the matrix runs the PP gate on such a tree (matrix.gate_release)
        "pp prefetch": "storage:pp" in capabilities,
        "independent-pool storage": {"storage:swa", "pool_group:swa"} <= set(capabilities),
        "mamba storage": {"storage:mamba", "pool_group:mamba"} <= set(capabilities),
        "buffer mode": "storage:buffer_only" in capabilities,
        # the PP gate draws SWA or Mamba worlds on such a tree (pp_gate.pp_worlds)
        "pp independent-pool tickets": "storage:pp" in capabilities
        and bool({"storage:swa", "storage:mamba"} & set(capabilities)),
        # the PP gate polls a cache-mode prefetch's verdict in every PP world (pp_gate.run_program)
        "pp timeout verdict": "storage:pp" in capabilities,
    }
    return [
        (name, NOT_DRIVEN_REASONS[name])
        for name in features_of(tree)
        if not driven.get(name, False)
    ]


def drove(report: CampaignReport) -> list[str]:
    """What the campaign drew, as shares of its cases: every pool-group world but ``none``,
    storage worlds and the forward on its own stream (empty parts left out)."""
    if not report.cases:
        return []
    parts = [
        f"group {kind} {world['share']:.0%}"
        for kind, world in report.world_shares().items()
        if kind != "none" and world["cases"]
    ]
    for feature, off, label in (
        ("storage", "none", "storage"),
        ("storage sidecar", ("none", "no storage"), "storage sidecar"),
        ("storage pressure", ("none", "no storage"), "host pressure"),
        ("storage swa", ("none", "no storage", "mamba"), "storage swa"),
        ("storage swa", ("none", "no storage", "swa"), "storage mamba"),
        ("storage mode", ("cache", "no storage"), "buffer mode"),
        ("forward", "default", "fences"),
    ):
        counts: Mapping[str, int] = report.features.get(feature, {})
        offs = (off,) if isinstance(off, str) else off
        share = sum(c for value, c in counts.items() if value not in offs) / report.cases
        if share:
            parts.append(f"{label} {share:.0%}")
    return parts
