"""Content keys of storage pages: a sha256 chain over the page's token ids.

A page's key commits to every token before it: ``key_i = sha256(bytes(key_{i-1}) || tokens_i)``
(INV-27: one key per whole-page prefix from the root).
Two requests that share a prefix therefore share the keys of its whole pages, and a page can only
be found in storage when every page before it has the same tokens. Tokens are hashed as 4-byte
little-endian unsigned integers; an EAGLE bigram token ``(a, b)`` contributes both elements.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Union

from hicache_ref.errors import HiCacheInputError

Token = Union[int, tuple[int, int]]
"""A token id, or an EAGLE bigram ``(token, next_token)``."""

TOKEN_ID_MAX = 2**32 - 1
"""Largest token id that fits the 4-byte unsigned encoding."""


def _flatten_tokens(token_ids: Sequence[Token]) -> list[int]:
    """Token ids in hashing order; a bigram contributes both of its elements."""
    flat: list[int] = []
    for token in token_ids:
        if isinstance(token, tuple):
            flat.extend(int(element) for element in token)
        else:
            flat.append(int(token))
    return flat


def _check_token_range(flat: list[int]) -> None:
    # Verify every id fits 4 unsigned bytes: struct would raise a bare error, and a silent
    # wrap-around would make two different prompts share a key.
    if flat and (min(flat) < 0 or max(flat) > TOKEN_ID_MAX):
        bad = next(t for t in flat if t < 0 or t > TOKEN_ID_MAX)
        raise HiCacheInputError(
            f"token id {bad} cannot be hashed: storage keys encode tokens as 4-byte unsigned "
            f"integers, so ids must lie in [0, {TOKEN_ID_MAX}]"
        )


def get_hash_str(token_ids: Sequence[Token], prior_hash: str | None = None) -> str:
    """The hex sha256 key of one page, chained onto ``prior_hash`` (the previous page's key)."""
    hasher = hashlib.sha256()
    if prior_hash:
        try:
            hasher.update(bytes.fromhex(prior_hash))
        except ValueError as exc:
            raise HiCacheInputError(
                f"prior_hash {prior_hash!r} is not a hex string (pass the previous page's key "
                "as returned by get_hash_str, or None for the first page)"
            ) from exc
    flat = _flatten_tokens(token_ids)
    _check_token_range(flat)
    hasher.update(struct.pack(f"<{len(flat)}I", *flat))
    return hasher.hexdigest()


def compute_page_hashes(
    token_ids: Sequence[Token], page_size: int, prior_hash: str | None = None
) -> list[str]:
    """Chained keys of every whole page of ``token_ids``; a trailing partial page has no key."""
    if page_size < 1:
        raise HiCacheInputError(f"page_size must be >= 1, got {page_size}")
    keys: list[str] = []
    last_hash = prior_hash
    whole_tokens = len(token_ids) - len(token_ids) % page_size
    for start in range(0, whole_tokens, page_size):
        last_hash = get_hash_str(token_ids[start : start + page_size], last_hash)
        keys.append(last_hash)
    # Verify one key per whole page, none for the partial tail
    assert len(keys) == len(token_ids) // page_size
    return keys
