"""What a release's gate drove, and what the release has that the gate does not drive.

The release matrix (``matrix.py``) reads a finding's absence as a fix only where the gate drove
the code the finding lives in. So each row says what ran (``drove``: the pool-group worlds
drawn, storage, the forward on its own stream, from the campaign's own counts) and what the
release's tree has that no world drives (``not_driven``: one reason each, read from the tree's
files, never from a finding's absence):

- ``features_of``: the tree's parts that matter to the gate, each detected by a file or a name
  in it (the storage threads, the ``HostPoolGroup``, its SWA and Mamba side pools, buffer mode,
  PP prefetch, decode context parallel);
- ``drove``: the campaign report's counts as a short list (``group swa 11%``, ``storage 8%``);
- ``not_driven``: each part the tree has and the implementation's capabilities leave out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport

MEM_CACHE = "sglang/srt/mem_cache"
HYBRID_CONTROLLER = f"{MEM_CACHE}/hybrid_cache/hybrid_cache_controller.py"

NOT_DRIVEN_REASONS: dict[str, str] = {
    "storage": "its controller lacks one of upstream's storage threads, or its tree no "
    "page-key hash the gate can compute (sglang_storage.supports_storage, sglang_hashes)",
    "side pools": "independent side pools need the hybrid controller's side-pool surface",
    "mamba side pool": "the harness models no per-request state pool (one slot per node, "
    "TRAILING_PAGES); only the SWA side pool is drawn (issue 27)",
    "storage in pool groups": "storage is drawn on the plain controller only, never with a "
    "HostPoolGroup (_page_transfer_sidecar, v2 batch calls; issue 27)",
    "buffer mode": "host-memory buffer mode (mem_cache/buffer_mode/) is not drawn (issue 27)",
    "pp prefetch": "the PP command thread and its tickets need two PP ranks (issue 27)",
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
        "mamba side pool": bool(hybrid_text) and (tree / MEM_CACHE / "pool_host/mamba.py").exists(),
        "storage in pool groups": "def write_storage" in hybrid_text,
        "buffer mode": (tree / MEM_CACHE / "buffer_mode").is_dir(),
        "pp prefetch": "pp_prefetch_command_thread_func" in hybrid_text,
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
    for feature, off, label in (("storage", "none", "storage"), ("forward", "default", "fences")):
        counts: Mapping[str, int] = report.features.get(feature, {})
        share = sum(c for value, c in counts.items() if value != off) / report.cases
        if share:
            parts.append(f"{label} {share:.0%}")
    return parts
