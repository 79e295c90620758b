"""Page keys: a sha256 chain over 4-byte little-endian tokens, one key per whole page."""

from __future__ import annotations

import hashlib

import pytest

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.hashing import compute_page_hashes, get_hash_str

KEY_123 = "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d"


def test_hash_of_first_page_is_sha256_of_little_endian_tokens() -> None:
    expected = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in (1, 2, 3))).hexdigest()
    assert get_hash_str([1, 2, 3]) == expected == KEY_123


def test_hash_chains_onto_the_prior_page_key() -> None:
    body = bytes.fromhex(KEY_123) + b"".join(t.to_bytes(4, "little") for t in (4, 5, 6))
    assert get_hash_str([4, 5, 6], KEY_123) == hashlib.sha256(body).hexdigest()
    assert get_hash_str([4, 5, 6], KEY_123) != get_hash_str([4, 5, 6])


def test_eagle_bigram_hashes_both_elements() -> None:
    assert get_hash_str([(1, 2), (3, 4)]) == get_hash_str([1, 2, 3, 4])
    assert get_hash_str([(1, 2)]) != get_hash_str([1])


def test_page_hashes_cover_whole_pages_only_and_chain() -> None:
    tokens = list(range(10))
    keys = compute_page_hashes(tokens, page_size=4)
    assert len(keys) == 2  # tokens 8, 9 are a partial page: no key
    assert keys[0] == get_hash_str(tokens[0:4])
    assert keys[1] == get_hash_str(tokens[4:8], keys[0])


def test_page_hashes_with_prior_continue_an_existing_chain() -> None:
    tokens = list(range(8))
    full = compute_page_hashes(tokens, page_size=4)
    assert compute_page_hashes(tokens[4:], 4, prior_hash=full[0]) == full[1:]


def test_shared_prefix_shares_keys_and_a_changed_token_changes_every_later_key() -> None:
    a = compute_page_hashes([1, 2, 3, 4, 5, 6], page_size=2)
    b = compute_page_hashes([1, 2, 3, 9, 5, 6], page_size=2)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


@pytest.mark.parametrize("token", [-1, 2**32])
def test_token_outside_four_unsigned_bytes_is_refused(token: int) -> None:
    with pytest.raises(HiCacheInputError, match=r"must lie in \[0, 4294967295\]"):
        get_hash_str([token])


def test_prior_hash_that_is_not_hex_is_refused() -> None:
    with pytest.raises(HiCacheInputError, match="not a hex string"):
        get_hash_str([1], "xyz")


def test_page_size_below_one_is_refused() -> None:
    with pytest.raises(HiCacheInputError, match="page_size must be >= 1"):
        compute_page_hashes([1, 2], 0)
