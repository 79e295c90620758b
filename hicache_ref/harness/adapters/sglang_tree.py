"""Unpacked sglang source trees: where the gate reads a controller that nobody here wrote.

A *tree* is a directory holding ``sglang/srt/managers/cache_controller.py`` and the few modules
that file imports (``srt/environ.py``, ``srt/mem_cache/hicache_storage.py``, ...): an unpacked
sglang wheel, a checkout's ``python/`` folder, or a copy of either with a modified controller.
The gate never imports sglang as a package (its import chain needs transformers, triton and
more); ``adapters/sglang.py`` loads the controller file from a tree behind stubs.

In the order a run needs them:

- ``fetch_wheel_tree(version)``: the release's tree from the cache directory
  (``HICACHE_CACHE_DIR``, default ``~/.cache/hicache_ref``), else ``pip download --no-deps
  sglang==<version>`` once, unpacked there; offline, a ``ReleaseUnavailable`` naming
  ``hicache-fuzz setup --from`` (``unpack_wheel``, ``copy_tree``: a wheel or a tree put there);
- ``fork_tree(controller_file)``: that tree with another ``cache_controller.py`` (the seed fork,
  or a developer's patched copy), or with any one other file replaced (``relpath``), built next
  to it, keyed by the file's hash;
- ``resolve_tree()``: the tree when no caller named one: ``HICACHE_SGLANG_SRC`` (how a pytest
  run names it; the CLI hands its ``--sglang-src`` to the adapter as an argument) if set, else
  0.5.10; ``recorded_tree(source)``: a trace's recorded tree, unless that variable names one;
- ``tree_release(tree)``: the release a tree says it is (its ``sglang/_version.py``), which
  scopes the known findings (``campaigns/known_findings.py``).

Every failure is a ``HiCacheSetupError`` whose one line says what is missing and the fix.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hicache_ref.errors import HiCacheSetupError

SGLANG_VERSION = "0.5.10"
SRC_ENV = "HICACHE_SGLANG_SRC"
SEED_FILE_ENV = "HICACHE_SEED_FILE"
CACHE_ENV = "HICACHE_CACHE_DIR"
CONTROLLER_RELPATH = Path("sglang/srt/managers/cache_controller.py")
VERSION_RELPATH = Path("sglang/_version.py")
_VERSION_LINE = re.compile(r"^__version__ = version = ['\"]([^'\"]+)['\"]", re.MULTILINE)
PIP_TIMEOUT_S = 300


def cache_root() -> Path:
    """Where fetched and derived trees live (``HICACHE_CACHE_DIR`` or ``~/.cache/hicache_ref``)."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env) if env else Path.home() / ".cache" / "hicache_ref"
    return root


def is_tree(path: Path) -> bool:
    return (Path(path) / CONTROLLER_RELPATH).is_file()


def check_tree(path: Path, label: str = "--sglang-src") -> Path:
    """``path`` itself (resolved) if it is a tree; else a one-line ``HiCacheSetupError`` that
    names what is missing and, for a near miss (a checkout, the package folder), the fix."""
    given = path
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise HiCacheSetupError(
            f"{label} {given}: no such folder; pass an unpacked sglang tree (the folder that "
            f"holds {CONTROLLER_RELPATH}; {SRC_ENV} does the same)"
        )
    if not is_tree(path):
        hint = ""
        if (path / "python" / CONTROLLER_RELPATH).is_file():
            hint = f" (a repository checkout: pass {path / 'python'})"
        elif path.name == "sglang" and (path.parent / CONTROLLER_RELPATH).is_file():
            hint = f" (that is the package itself: pass its parent {path.parent})"
        raise HiCacheSetupError(
            f"{label} {given}: expected {path / CONTROLLER_RELPATH}, which is missing{hint}; "
            f"pass the folder that holds {CONTROLLER_RELPATH}"
        )
    return path


def wheel_tree_path(version: str = SGLANG_VERSION) -> Path:
    return cache_root() / f"sglang-{version}"


class ReleaseUnavailable(HiCacheSetupError):
    """A release the cache lacks could not be fetched (no network, or no such wheel); the
    message names the command that fills the cache from a file instead."""

    def __init__(self, version: str, why: str) -> None:
        self.version = version
        self.fill = f"hicache-fuzz setup --from sglang-{version}-py3-none-any.whl"
        super().__init__(
            f"sglang {version} is not in the cache ({cache_root()}) and {why}; on a machine "
            f"without the package index, fill the cache from a wheel or an unpacked tree: "
            f"{self.fill} (or a tree folder)"
        )


def _cache_folder() -> Path:
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HiCacheSetupError(
            f"cannot create the cache directory {root} ({exc.strerror}); set {CACHE_ENV} to a "
            "writable folder"
        ) from None
    return root


def fetch_wheel_tree(version: str = SGLANG_VERSION) -> Path:
    """The unpacked sglang ``version`` wheel: from the cache (``setup`` or ``setup --from``
    put it there), else fetched with pip once."""
    target = wheel_tree_path(version)
    if is_tree(target):
        return target
    with tempfile.TemporaryDirectory(dir=_cache_folder(), prefix=".fetch-") as tmp:
        wheel = _download_wheel(version, Path(tmp))
        return unpack_wheel(wheel, target)


def unpack_wheel(wheel: Path, target: Path) -> Path:
    """``wheel`` unpacked as the tree ``target`` (built beside it, then moved in whole)."""
    with tempfile.TemporaryDirectory(dir=_cache_folder(), prefix=".unpack-") as tmp:
        staging = Path(tmp) / "tree"
        try:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(staging)
        except (zipfile.BadZipFile, OSError) as exc:
            raise HiCacheSetupError(
                f"{wheel} is not a readable wheel ({type(exc).__name__}); pass the file pip "
                "download sglang==X wrote"
            ) from None
        if not is_tree(staging):
            raise HiCacheSetupError(
                f"{wheel.name} has no {CONTROLLER_RELPATH}; gate a release that has one"
            )
        _move_in(staging, target)
    return target


def copy_tree(tree: Path, target: Path) -> Path:
    """The ``sglang/`` package of ``tree`` copied as the tree ``target``."""
    with tempfile.TemporaryDirectory(dir=_cache_folder(), prefix=".copy-") as tmp:
        staging = Path(tmp) / "tree"
        shutil.copytree(tree / "sglang", staging / "sglang")
        _move_in(staging, target)
    return target


def _move_in(staging: Path, target: Path) -> None:
    if target.exists() and not is_tree(target):
        shutil.rmtree(target)  # a half-written folder of an earlier, interrupted run
    if is_tree(target):
        shutil.rmtree(target)  # setup --from replaces what the cache held for that release
    try:
        os.replace(staging, target)
    except OSError:
        if not is_tree(target):  # a concurrent fetch that won the race is fine
            raise


def _download_wheel(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into)]
    command.append(f"sglang=={version}")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"`pip download sglang=={version}` did not finish ({type(exc).__name__})"
        raise ReleaseUnavailable(version, why) from None
    wheels = sorted(into.glob("sglang-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or done.stdout or "no output").strip().splitlines()[-1:] or [""]
        why = f"`pip download --no-deps sglang=={version}` failed: {last[0][:160]}"
        raise ReleaseUnavailable(version, why)
    return wheels[0]


def fork_tree(
    controller_file: Path, base: Path | None = None, relpath: Path = CONTROLLER_RELPATH
) -> Path:
    """A tree equal to ``base`` (default: the 0.5.10 wheel) but with ``controller_file`` as its
    ``cache_controller.py``, or as the tree's file at ``relpath`` (any one file of ``sglang/``:
    a patched ``hicache_storage.py`` or ``mem_cache/utils.py``). Built once per file content and
    place, beside the base tree."""
    controller_file, relpath = Path(controller_file), Path(relpath)
    if not controller_file.is_file():
        raise HiCacheSetupError(
            f"controller file {controller_file} does not exist; pass the path of a "
            "cache_controller.py (for the seed fork: its re-indented copy)"
        )
    source = controller_file.read_bytes()
    base = check_tree(base) if base is not None else fetch_wheel_tree()
    # Verify the file replaces one the tree has (a typo would fork an unchanged tree)
    if relpath.is_absolute() or relpath.parts[:1] != ("sglang",) or not (base / relpath).is_file():
        raise HiCacheSetupError(
            f"{relpath} is not a file of the tree {base}; pass the path of one of its files "
            f"relative to the tree, such as {CONTROLLER_RELPATH}"
        )
    place = b"" if relpath == CONTROLLER_RELPATH else str(relpath).encode()
    digest = hashlib.sha256(source + str(base).encode() + place).hexdigest()[:12]
    target = cache_root() / f"{base.name}-fork-{digest}"
    if is_tree(target) and (target / relpath).read_bytes() == source:
        return target
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".fork-") as tmp:
        staging = Path(tmp) / "tree"
        shutil.copytree(base / "sglang", staging / "sglang", copy_function=_link_or_copy)
        replaced = staging / relpath
        replaced.unlink()  # a hard link: never write through it into the base tree
        replaced.write_bytes(source)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    return target


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def resolve_tree() -> Path:
    """The tree to gate: ``HICACHE_SGLANG_SRC`` if set, else the 0.5.10 wheel (fetched once)."""
    env = os.environ.get(SRC_ENV)
    if env:
        return check_tree(Path(env), SRC_ENV)
    return fetch_wheel_tree()


def recorded_tree(source: str) -> str:
    """The tree a replay reads for a trace that recorded ``source``: ``HICACHE_SGLANG_SRC`` when
    set (a pytest run re-pointing the gate at another tree), else ``source`` itself."""
    return os.environ.get(SRC_ENV) or source


def resolve_seed_tree() -> Path:
    """The seed fork's tree: ``HICACHE_SGLANG_SRC`` if set, else one built from
    ``HICACHE_SEED_FILE`` (the seed's re-indented controller) over the 0.5.10 wheel."""
    env = os.environ.get(SRC_ENV)
    if env:
        return check_tree(Path(env), SRC_ENV)
    seed = os.environ.get(SEED_FILE_ENV)
    if not seed:
        raise HiCacheSetupError(
            f"--impl seed needs the fork's controller: set {SEED_FILE_ENV} to the seed's "
            f"re-indented cache_controller file, or --sglang-src / {SRC_ENV} to a fork tree"
        )
    return fork_tree(Path(seed))


def tree_release(tree: Path) -> str:
    """The release ``tree`` was built as (``__version__`` in its generated ``_version.py``);
    empty for a tree without one (a checkout that was never built)."""
    path = tree / VERSION_RELPATH
    found = _VERSION_LINE.search(path.read_text()) if path.is_file() else None
    return found.group(1) if found is not None else ""
