"""The titles shipped in the package are the spec's: ``specs/invariant_ids.txt`` line by line."""

from __future__ import annotations

from pathlib import Path

from hicache_ref.invariant_titles import (
    INVARIANT_TITLES,
    get_invariant_label,
    parse_invariant_titles,
    render_titles_block,
)

IDS_FILE = Path(__file__).resolve().parents[1] / "specs" / "invariant_ids.txt"
MODULE = Path(__file__).resolve().parents[1] / "hicache_ref" / "invariant_titles.py"


def test_the_shipped_titles_are_the_specs() -> None:
    spec = parse_invariant_titles(IDS_FILE.read_text())
    assert spec == INVARIANT_TITLES, (
        "hicache_ref/invariant_titles.py drifted from specs/invariant_ids.txt; regenerate it: "
        "python -m hicache_ref.invariant_titles specs/invariant_ids.txt"
    )
    assert list(spec) == list(INVARIANT_TITLES)  # in the spec's order too
    # Verify the module spells the block exactly as its generator writes it
    assert render_titles_block(spec) in MODULE.read_text()


def test_a_label_is_the_id_and_its_title() -> None:
    assert get_invariant_label("INV-02") == "INV-02 single-write-ack"
    assert get_invariant_label("IndexError") == "IndexError"  # a failure that is no violation
