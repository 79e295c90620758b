"""The tree's page-key hash functions, read from its own ``utils.py`` without its kernels.

``tree_hash_functions(tree)`` executes whichever of ``get_hash_str`` / ``storage_namespace_seed`` /
``get_storage_hash_str`` the tree's ``utils.py`` defines (0.5.11 - 0.5.19: ``get_hash_str`` alone,
pure ``hashlib`` up to 0.5.12, over the native hash from 0.5.13; 0.5.20+: all three) over a
Python stand-in for its C++ ``get_native_hash``; the stubs hand them to the controller
(``sglang_stubs.install_stubs``), and ``page_keys_function`` computes a node's page keys as the
tree's radix cache does (``sglang_storage``'s ``write_storage``). 0.5.10 keeps ``get_hash_str``
in ``hicache_storage.py`` (loaded by the stubs). It imports nothing else of the adapters, so both
can use it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hicache_ref.errors import HiCacheSetupError

UTILS_RELPATH = Path("sglang/srt/mem_cache/utils.py")
HASH_FUNCTIONS = ("get_hash_str", "storage_namespace_seed", "get_storage_hash_str")


def _python_native_hash(
    token_ids: Any, prior_digest: bytes | None, page_size: int | None = None
) -> str | list[str]:
    """What the tree's C++ ``get_native_hash`` computes for plain token lists: SHA-256 over the
    prior digest and each token as 4 little-endian bytes, one digest per page when
    ``page_size`` is given, each chained from the last (the gate builds no C++ extension)."""
    tokens = [int(t) for t in token_ids]

    def digest(chunk: Sequence[int], prior: bytes | None) -> bytes:
        hasher = hashlib.sha256()
        if prior:
            hasher.update(prior)
        for t in chunk:
            hasher.update(t.to_bytes(4, "little", signed=False))
        return hasher.digest()

    if page_size is None:
        return digest(tokens, prior_digest).hex()
    keys: list[str] = []
    prior = prior_digest
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = digest(tokens[start : start + page_size], prior)
        keys.append(prior.hex())
    return keys


@functools.cache
def tree_hash_functions(tree: Path) -> dict[str, Any]:
    """The tree's own ``get_hash_str`` / ``get_storage_hash_str`` (read from its ``utils.py``,
    which imports kernels the gate does not load), over the Python stand-in for its native hash."""
    path = tree / UTILS_RELPATH
    if not path.is_file():
        raise HiCacheSetupError(f"the sglang tree lacks {path}; gate a complete unpacked tree")
    parsed = ast.parse(path.read_text(), str(path))
    wanted: list[ast.stmt] = [
        n for n in parsed.body if isinstance(n, ast.FunctionDef) and n.name in HASH_FUNCTIONS
    ]
    names = [n.name for n in wanted if isinstance(n, ast.FunctionDef)]
    if "get_hash_str" not in names:
        raise HiCacheSetupError(f"{path} defines no get_hash_str (0.5.10 keeps it elsewhere)")
    namespace: dict[str, Any] = {"get_native_hash": _python_native_hash, "hashlib": hashlib}
    exec("from __future__ import annotations\nfrom typing import *\n", namespace)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


def page_keys_function(tree: Path) -> Callable[[list[Any], str | None, int], list[str]]:
    """The keys of a node's pages as the tree's radix cache computes them: 0.5.20+'s
    ``get_storage_hash_str`` over all pages, else ``get_hash_str`` chained page by page
    (``compute_node_hash_values``): 0.5.11 - 0.5.19's from ``utils.py``, 0.5.10's from
    ``hicache_storage.py`` (loaded by the stubs)."""
    try:
        functions = tree_hash_functions(tree)
    except HiCacheSetupError:
        functions = {}
    storage_hash = functions.get("get_storage_hash_str")
    if storage_hash is not None:
        return lambda tokens, prior, page: list(storage_hash(tokens, prior, page_size=page))
    get_hash_str = (
        functions.get("get_hash_str")
        or (sys.modules["sglang.srt.mem_cache.hicache_storage"].__dict__["get_hash_str"])
    )

    def chained(tokens: list[Any], prior: str | None, page: int) -> list[str]:
        keys: list[str] = []
        for start in range(0, len(tokens) - len(tokens) % page, page):
            prior = str(get_hash_str(tokens[start : start + page], prior))
            keys.append(prior)
        return keys

    return chained
