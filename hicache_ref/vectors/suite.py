"""Suite files: gzip'd JSON Lines, a ``SuiteHeader`` then one ``Vector`` per line.

``write_suite`` writes byte-identical files for identical vectors (gzip without a timestamp,
canonical JSON), so a regenerated suite can be compared with a shipped one. ``read_suite``
trusts nothing: every line must be JSON, match the schema (the pydantic models), carry the
digest of its own content, and the header must count and digest exactly the vectors that
follow. Anything else is one ``HiCacheInputError`` naming the line and the fix: an edited
expectation is rejected, never replayed.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from hicache_ref.errors import HiCacheInputError
from hicache_ref.vectors.models import (
    FORMAT_VERSION,
    SuiteHeader,
    Vector,
    canonical_json,
    compute_digest,
    compute_suite_digest,
)

SHIPPED_SUITE = "v1.jsonl.gz"
REGENERATE = "regenerate it with hicache-fuzz vectors generate"


def shipped_suite_path() -> Path:
    """The suite this package ships (``hicache_ref/vectors/suites/v1.jsonl.gz``)."""
    return Path(str(resources.files("hicache_ref.vectors") / "suites" / SHIPPED_SUITE))


def suite_lines(header: SuiteHeader, vectors: Sequence[Vector]) -> str:
    lines = [canonical_json(header.model_dump(mode="json"))]
    lines += [canonical_json(v.model_dump(mode="json")) for v in vectors]
    return "\n".join(lines) + "\n"


def write_suite(path: Path, header: SuiteHeader, vectors: Sequence[Vector]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = suite_lines(header, vectors).encode()
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    path.write_bytes(buffer.getvalue())
    return path


def _text_of(path: Path) -> str:
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise HiCacheInputError(f"suite {path} {what}; pass a .jsonl.gz suite ({REGENERATE})")
    data = path.read_bytes()
    try:
        raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        return raw.decode()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise HiCacheInputError(
            f"suite {path} is not gzip'd UTF-8 JSON Lines ({exc}); {REGENERATE}"
        ) from None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "value"
    return f"{where}: {first['msg']}"


def read_suite(path: Path) -> tuple[SuiteHeader, list[Vector]]:
    """The header and the vectors of a suite file, every line checked (module docstring)."""
    lines = [(n, line) for n, line in enumerate(_text_of(path).splitlines(), 1) if line.strip()]
    if not lines:
        raise HiCacheInputError(f"suite {path} is empty; {REGENERATE}")
    records = []
    for number, line in lines:
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise HiCacheInputError(
                f"suite {path} line {number} is not JSON ({exc.msg}); {REGENERATE}"
            ) from None
    number, first = records[0]
    if not isinstance(first, dict) or first.get("format_version") != FORMAT_VERSION:
        version = first.get("format_version") if isinstance(first, dict) else None
        raise HiCacheInputError(
            f"suite {path} line {number} has format_version {version!r}; this hicache_ref "
            f"reads {FORMAT_VERSION!r} ({REGENERATE})"
        )
    try:
        header = SuiteHeader.model_validate(first)
    except ValidationError as exc:
        raise HiCacheInputError(
            f"suite {path} line {number} is not a suite header ({_first_error(exc)}); {REGENERATE}"
        ) from None
    vectors = []
    for number, record in records[1:]:
        try:
            vector = Vector.model_validate(record)
        except ValidationError as exc:
            raise HiCacheInputError(
                f"suite {path} line {number} is not a valid vector ({_first_error(exc)}); "
                f"{REGENERATE}"
            ) from None
        # Verify the vector is what was generated: an edited expectation changes its digest
        if compute_digest(record) != vector.digest:
            raise HiCacheInputError(
                f"suite {path} line {number}: vector {vector.id} does not match its digest "
                f"{vector.digest} (edited after it was generated); {REGENERATE}"
            )
        vectors.append(vector)
    # Verify the header names exactly these vectors (none dropped, added or reordered)
    digest = compute_suite_digest([v.digest for v in vectors])
    if header.vectors != len(vectors) or header.digest != digest:
        raise HiCacheInputError(
            f"suite {path}: the header promises {header.vectors} vectors with digest "
            f"{header.digest[:16]}..., the file holds {len(vectors)} with {digest[:16]}... "
            f"(vectors dropped, added or reordered); {REGENERATE}"
        )
    return header, vectors
