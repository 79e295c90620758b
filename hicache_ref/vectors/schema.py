"""The vector format as standard JSON Schema (draft 2020-12), exported from the models.

``suite_schema()`` is one schema with two entry points under ``$defs``: ``SuiteHeader`` for a
suite's first line and ``Vector`` for every other line. It is shipped as
``hicache_ref/vectors/schema/suite-v1.schema.json`` (``tests/vectors`` keeps the file equal to
the models, and CI validates the shipped suite against it with ``ajv``, a validator that is not
Python); ``hicache-fuzz vectors schema`` writes it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from hicache_ref.vectors.models import SuiteHeader, Vector

SCHEMA_FILE = "suite-v1.schema.json"
SCHEMA_ID = "https://hicache-ref.invalid/schema/suite-v1.schema.json"


def suite_schema() -> dict[str, Any]:
    """The schema document: the vector's own schema, with the header beside it in ``$defs``."""
    vector = Vector.model_json_schema(ref_template="#/$defs/{model}")
    header = SuiteHeader.model_json_schema(ref_template="#/$defs/{model}")
    defs: dict[str, Any] = dict(vector.pop("$defs", {}))
    defs.update(header.pop("$defs", {}))
    defs["Vector"] = vector
    defs["SuiteHeader"] = header
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "hicache_ref conformance suite, format hicache-vector/1",
        "description": "Line 1 of a suite is a SuiteHeader, every other line a Vector "
        "(see specs/vectors.md).",
        "anyOf": [{"$ref": "#/$defs/SuiteHeader"}, {"$ref": "#/$defs/Vector"}],
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    return json.dumps(suite_schema(), indent=2, sort_keys=True) + "\n"


def shipped_schema_path() -> Path:
    return Path(str(resources.files("hicache_ref.vectors") / "schema" / SCHEMA_FILE))
