"""Upstream releases by name: a version checked, a range resolved against the registry's list.

In the order the release matrix needs them:

- ``check_version(text)``: ``0.5.17`` or ``0.5.15.post1`` (final and post releases; the gate
  does not take pre-releases), else one ``HiCacheInputError`` line;
- ``registry_versions()``: every sglang release on the package index (``pip index versions
  sglang``), cached for a day in the cache directory beside the trees; offline, the last list
  fetched, and failing that the releases whose trees are already in the cache;
- ``fetch_release_tree(version)``: that release's wheel, fetched once into the cache;
- ``install_release(path)``: ``hicache-fuzz setup --from``: a wheel file or an unpacked tree
  put into the cache under its release, with no network, so every command, test and benchmark
  that asks for that release finds it there (an air-gapped GPU runner);
- ``resolve_releases(spec)``: ``0.5.10..0.5.23`` (every release in between, post releases
  included, in version order) or a comma list ``0.5.10,0.5.23`` (as given).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.harness.adapters.sglang_tree import (
    PIP_TIMEOUT_S,
    cache_root,
    check_tree,
    copy_tree,
    fetch_wheel_tree,
    is_tree,
    tree_release,
    unpack_wheel,
    wheel_tree_path,
)

VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")
VERSIONS_CACHE = "sglang-versions.json"
VERSIONS_MAX_AGE_S = 24 * 3600
RANGE_SEP = ".."
VersionKey = tuple[int, int, int, int]


def check_version(text: str, flag: str = "--sglang-version") -> str:
    """``text`` if it names a final or post release (``0.5.17``, ``0.5.15.post1``)."""
    version = text.strip()
    if VERSION_RE.match(version) is None:
        raise HiCacheInputError(
            f"{flag} {text!r} is not a release number; write one such as 0.5.17 or "
            "0.5.15.post1 (a tree or a git checkout: --sglang-src DIR)"
        )
    return version


def compute_version_key(version: str) -> VersionKey:
    """Order of releases: 0.5.10 < 0.5.10.post1 < 0.5.11."""
    found = VERSION_RE.match(version)
    assert found is not None, f"{version!r} was not checked"
    major, minor, patch, post = found.groups()
    return (int(major), int(minor), int(patch), int(post) if post is not None else -1)


def _is_release(version: str) -> bool:
    return VERSION_RE.match(version) is not None


def cached_tree_versions() -> list[str]:
    """Releases whose unpacked wheel is in the cache (fork trees and partial fetches left out)."""
    root = cache_root()
    if not root.is_dir():
        return []
    found = [
        path.name.removeprefix("sglang-")
        for path in root.glob("sglang-*")
        if is_tree(path) and _is_release(path.name.removeprefix("sglang-"))
    ]
    return sorted(found, key=compute_version_key)


def _query_registry() -> list[str] | None:
    command = [sys.executable, "-m", "pip", "index", "versions", "sglang"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        if line.strip().startswith("Available versions:"):
            listed = line.split(":", 1)[1].split(",")
            return sorted(
                {v.strip() for v in listed if _is_release(v.strip())}, key=compute_version_key
            )
    return None


def registry_versions(*, max_age_s: float = VERSIONS_MAX_AGE_S) -> tuple[list[str], str]:
    """(every release on the index, where the list came from: registry, cache or trees)."""
    path = cache_root() / VERSIONS_CACHE
    cached: dict[str, object] = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    listed = cached.get("versions")
    fetched = cached.get("fetched")
    if isinstance(listed, list) and isinstance(fetched, (int, float)):
        if time.time() - fetched < max_age_s:
            return [str(v) for v in listed], "registry (cached)"
    fresh = _query_registry()
    if fresh:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fetched": time.time(), "versions": fresh}) + "\n")
        except OSError:
            pass  # an unwritable cache only costs a query next time
        return fresh, "registry"
    if isinstance(listed, list):
        return [str(v) for v in listed], "registry (stale cache, offline)"
    return cached_tree_versions(), "cached trees (offline)"


def resolve_releases(spec: str, known: Sequence[str] | None = None) -> list[str]:
    """The releases ``spec`` names: ``LO..HI`` against the registry (or ``known``), or a list."""
    text = spec.strip()
    if RANGE_SEP not in text:
        names = [check_version(part, "--matrix") for part in text.split(",") if part.strip()]
        if not names:
            raise HiCacheInputError("--matrix is empty; write LO..HI or a comma list of releases")
        return list(dict.fromkeys(names))
    low_text, _, high_text = text.partition(RANGE_SEP)
    low, high = check_version(low_text, "--matrix"), check_version(high_text, "--matrix")
    if compute_version_key(low) > compute_version_key(high):
        raise HiCacheInputError(f"--matrix {spec}: {low} comes after {high}; write LO..HI")
    versions = list(known) if known is not None else registry_versions()[0]
    lo_key, hi_key = compute_version_key(low), compute_version_key(high)
    chosen = [v for v in versions if lo_key <= compute_version_key(v) <= hi_key]
    if not chosen:
        raise HiCacheInputError(
            f"--matrix {spec}: no release between {low} and {high} is known (offline and none "
            "cached); fetch one with hicache-fuzz setup --sglang-version X"
        )
    return sorted(set(chosen), key=compute_version_key)


def fetch_release_tree(version: str, flag: str = "--sglang-version") -> Path:
    """The unpacked wheel of release ``version``, fetched once into the cache."""
    return fetch_wheel_tree(check_version(version, flag))


_WHEEL_NAME = re.compile(r"^sglang-([^-]+)-.*\.whl$")


def install_release(path: Path) -> tuple[str, Path]:
    """``setup --from PATH``: a wheel (``sglang-X-py3-none-any.whl``) or an unpacked tree of any
    release, copied into the cache as that release's tree, with no network; (release, tree)."""
    given = Path(path).expanduser()
    if given.is_file():
        found = _WHEEL_NAME.match(given.name)
        if found is None:
            raise HiCacheInputError(
                f"--from {path}: not an sglang wheel (sglang-<release>-...whl); pass the wheel "
                "file pip download sglang==X wrote, or an unpacked tree"
            )
        version = check_version(found.group(1), "--from (the wheel's release)")
        return version, unpack_wheel(given, wheel_tree_path(version))
    tree = check_tree(given, "--from")
    version = tree_release(tree)
    if not version:
        raise HiCacheSetupError(
            f"--from {path}: the tree does not say its release (no {tree / 'sglang/_version.py'}"
            "); gate it with --sglang-src instead, or pass the wheel it came from"
        )
    version = check_version(version, "--from (the tree's release)")
    target = wheel_tree_path(version)
    if tree != target.resolve():
        copy_tree(tree, target)
    return version, target
