"""Every invariant id with its title, as ``specs/invariant_ids.txt`` names them.

The spec file is the source; this module ships its ids and titles inside the package, so a
report or a summary installed from a wheel can say ``INV-02 single-write-ack`` instead of a
bare id. ``tests/test_invariant_titles.py`` fails when the two drift apart and names the fix:
``python -m hicache_ref.invariant_titles specs/invariant_ids.txt`` rewrites ``INVARIANT_TITLES``
from the spec file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

INVARIANT_TITLES: dict[str, str] = {
    # generated from specs/invariant_ids.txt: python -m hicache_ref.invariant_titles
    "INV-01": "page-alignment",
    "INV-02": "single-write-ack",
    "INV-03": "owner-replay",
    "INV-04": "layer-completeness",
    "INV-05": "slot-conservation",
    "INV-06": "byte-equality",
    "INV-07": "no-host-free-in-flight",
    "INV-08": "no-device-free-in-flight",
    "INV-09": "fifo-ack-drain",
    "INV-10": "producer-slot",
    "INV-11": "layer-gate",
    "INV-12": "store-before-backup",
    "INV-13": "cp-metadata",
    "INV-14": "cp-ack-rows",
    "INV-15": "cancel-quiesces",
    "INV-16": "acked-once",
    "INV-17": "write-failure-clean",
    "INV-18": "reset-clean",
    "INV-19": "prefetch-ranges",
    "INV-20": "storage-collectives",
    "INV-21": "min-progress",
    "INV-22": "verdict-after-hit",
    "INV-23": "io-owned-bounce-pages",
    "INV-24": "storage-epochs",
    "INV-25": "one-storage-ack",
    "INV-26": "ack-is-stored-prefix",
    "INV-27": "prefix-chained-keys",
    "INV-28": "key-namespace",
    "INV-29": "hit-endpoint",
    "INV-30": "l3-bytes",
    "INV-31": "l3-prefix-closed",
    "INV-32": "acked-pages-readable",
    "INV-33": "no-read-after-termination",
    "INV-34": "no-progress-past-a-hole",
    "INV-35": "no-old-epoch-thread",
    "INV-36": "pool-own-indices",
    "INV-37": "sidecar-all-or-nothing",
    "INV-38": "pp-ticket-agreement",
    "INV-39": "side-window-of-the-served-hit",
    "INV-40": "state-slot-per-node",
    "INV-41": "buffer-staging-and-beliefs",
}
_ID_LINE = re.compile(r"^(INV-\d\d) ([a-z0-9-]+):")


def get_invariant_label(inv_id: str) -> str:
    """``INV-02 single-write-ack`` for an id; any other failure kind (an exception type) as is."""
    title = INVARIANT_TITLES.get(inv_id)
    return f"{inv_id} {title}" if title else inv_id


def parse_invariant_titles(text: str) -> dict[str, str]:
    """Ids and titles of the lines of ``specs/invariant_ids.txt`` (``INV-xx title: statement``)."""
    titles: dict[str, str] = {}
    for line in text.splitlines():
        found = _ID_LINE.match(line)
        if found is not None:
            titles[found.group(1)] = found.group(2)
    return titles


def render_titles_block(titles: dict[str, str]) -> str:
    """The ``INVARIANT_TITLES`` assignment as this module spells it."""
    body = "".join(f'    "{inv_id}": "{title}",\n' for inv_id, title in titles.items())
    return (
        "INVARIANT_TITLES: dict[str, str] = {\n"
        "    # generated from specs/invariant_ids.txt: python -m hicache_ref.invariant_titles\n"
        f"{body}}}\n"
    )


def main(argv: list[str]) -> int:
    """Rewrite this module's ``INVARIANT_TITLES`` from the spec file named by ``argv[0]``."""
    spec = Path(argv[0] if argv else "specs/invariant_ids.txt")
    module = Path(__file__)
    text = module.read_text()
    start = text.index("INVARIANT_TITLES: dict[str, str] = {")
    end = text.index("}\n", start) + 2
    block = render_titles_block(parse_invariant_titles(spec.read_text()))
    module.write_text(text[:start] + block + text[end:])
    print(f"{module}: {len(parse_invariant_titles(spec.read_text()))} invariant titles from {spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
