"""The vector format: the shipped schema file equals the models', the shipped suite reads back
intact, and a tampered suite (an edited expectation, broken JSON, a line off the schema, a
dropped vector) is rejected in one line naming the line and the fix."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hicache_ref.cli import main
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.rules import RULES
from hicache_ref.vectors.coverage import INVARIANT_IDS
from hicache_ref.vectors.models import FORMAT_VERSION
from hicache_ref.vectors.schema import schema_text, shipped_schema_path
from hicache_ref.vectors.settle import reads_completion
from hicache_ref.vectors.suite import read_suite, shipped_suite_path
from tests.vectors.conftest import shipped

REPO = Path(__file__).resolve().parents[2]


def _lines() -> list[str]:
    return gzip.decompress(shipped_suite_path().read_bytes()).decode().splitlines()


def _write(path: Path, lines: list[str]) -> Path:
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def test_the_shipped_schema_file_is_the_models_schema() -> None:
    # regenerate with: hicache-fuzz vectors schema --out hicache_ref/vectors/schema/suite-v1.schema.json
    assert shipped_schema_path().read_text() == schema_text()


def test_the_shipped_suite_reads_back_with_every_digest() -> None:
    header, vectors = shipped()
    assert header.format_version == FORMAT_VERSION
    assert header.vectors == len(vectors) >= 500
    assert len({v.id for v in vectors}) == len(vectors)


def test_the_package_knows_the_spec_s_invariant_ids() -> None:
    spec = (REPO / "specs" / "invariant_ids.txt").read_text().split()
    assert list(INVARIANT_IDS) == sorted(word for word in spec if word.startswith("INV-"))


def test_what_a_rule_reads_of_stream_completion_is_its_records() -> None:
    # the drains read finished acks of the queues they drain; a probe, a scribble and a reset
    # with copies queued need a copy surely in flight; the storage rules read none of it
    reads = {name: reads_completion(name) for name in RULES}
    assert {n for n, r in reads.items() if r == "acks"} == {
        "drain_write",
        "drain_load",
        "drain_acks",
    }
    in_flight = {"probe_evict_host", "probe_evict_device", "reset_in_flight", "scribble_free_host"}
    assert {n for n, r in reads.items() if r == "in_flight"} == in_flight
    assert RULES["drain_write"].completion.drains == ("write",)
    assert RULES["probe_evict_host"].completion.in_flight == ("write",)  # its backup's copy


def test_an_edited_expectation_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _lines()
    record = json.loads(lines[1])
    record["steps"][0]["expect"]["status"] = "refused"  # someone "fixes" an expectation by hand
    lines[1] = json.dumps(record)
    path = _write(tmp_path / "tampered.jsonl.gz", lines)
    with pytest.raises(HiCacheInputError, match=r"line 2: vector \S+ does not match its digest"):
        read_suite(path)
    assert main(["vectors", "replay", str(path)]) == 2
    assert "does not match its digest" in capsys.readouterr().err


def test_broken_json_is_rejected(tmp_path: Path) -> None:
    lines = _lines()
    lines[3] = lines[3][:-5]
    with pytest.raises(HiCacheInputError, match="line 4 is not JSON"):
        read_suite(_write(tmp_path / "broken.jsonl.gz", lines))


def test_a_line_off_the_schema_is_rejected(tmp_path: Path) -> None:
    lines = _lines()
    record = json.loads(lines[2])
    record["steps"][0]["op"] = "teleport"
    lines[2] = json.dumps(record)
    with pytest.raises(HiCacheInputError, match=r"line 3 is not a valid vector \(steps.0.op"):
        read_suite(_write(tmp_path / "schema.jsonl.gz", lines))


def test_a_dropped_vector_is_rejected(tmp_path: Path) -> None:
    lines = _lines()
    del lines[5]
    with pytest.raises(HiCacheInputError, match="vectors dropped, added or reordered"):
        read_suite(_write(tmp_path / "dropped.jsonl.gz", lines))


def test_a_missing_suite_and_another_format_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(HiCacheInputError, match="does not exist"):
        read_suite(tmp_path / "nothing.jsonl.gz")
    lines = _lines()
    header = json.loads(lines[0])
    header["format_version"] = "hicache-vector/0"
    lines[0] = json.dumps(header)
    with pytest.raises(HiCacheInputError, match="has format_version 'hicache-vector/0'"):
        read_suite(_write(tmp_path / "old.jsonl.gz", lines))
