"""The vector format as pydantic models (``specs/vectors.md`` says what every field means).

A suite is gzip'd JSON Lines: one ``SuiteHeader``, then one ``Vector`` per line. A vector is a
configuration, a program of steps in the controller's vocabulary (the harness's rules: the tree
driver's verbs, stream completions, misuse probes, resets) and, after every step and at
quiescence, what a conforming implementation must produce (``Expect``, ``Final``). Where the
contract leaves a choice to the implementation (which free slot, which producer slot), the
observation is normalized (counts, node-relative content, owner patterns), never the choice.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from hicache_ref.harness.step_types import RuleName, StepArg
from hicache_ref.harness.world.config import HarnessConfig

FORMAT_VERSION: Literal["hicache-vector/1"] = "hicache-vector/1"
SUITE_VERSION = "v1"
InvId = Annotated[str, StringConstraints(pattern=r"^INV-\d\d$")]
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
RefusalReason = Literal[
    "device_capacity",  # prefill or load: the device allocator had too few free pages
    "forward_batch_midway",  # prefill: a forward batch is mid-way (the tree refuses, no call)
    "host_capacity",  # write / reserve: a rank's host pool is short of the node's pages
    "draft_host_capacity",  # reserve: only the CP draft host pool is short
    "undrained_ack",  # reserve: the node still has an undrained write ack
    "refused",  # a refusal the harness's accounting does not explain further
]
Schedule = Literal["any", "sim", "ops"]
"""``any``: every completion-observing step happens after the streams it reads were
synchronized, so the vector replays on any device; ``sim``: some step relies on work not
having run yet (nothing runs until the replayer runs it), which only a simulated device
guarantees; ``ops``: some step reads completion after a partial ``advance``, so its answer
holds for the reference's own device ops only (a regression vector for the reference and its
mutants; every other implementation skips it)."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Returned(BaseModel):
    """Indices an accepted call returned, normalized: how many, and whether whole pages."""

    model_config = _FROZEN

    count: int = Field(ge=0, description="indices returned (summed over CP ranks for a write)")
    aligned: bool = Field(description="every index span is whole, aligned pages (INV-01)")


class AckRows(BaseModel):
    """Ack rows by queue: each row is the node ids of one ack, in queue order."""

    model_config = _FROZEN

    write: list[list[int]] = Field(default_factory=list)
    load: list[list[int]] = Field(default_factory=list)


class Holding(BaseModel):
    """What one rank's pools hold (counts of pages; which pages is the implementation's)."""

    model_config = _FROZEN

    device_pages: int = Field(ge=0)
    host_pages: int = Field(ge=0)
    draft_host_pages: int | None = Field(
        default=None, ge=0, description="the CP draft host pool; null without one"
    )


class CopyBytes(BaseModel):
    """One copy of one node: a digest per page of the node (page j holds tokens
    [j*page_size, min((j+1)*page_size, logical_len)) of content id ``node``)."""

    model_config = _FROZEN

    node: int = Field(ge=0, description="the node's handle, which is also its content id")
    copy_kind: Literal["device", "host"]
    pages: list[Digest]


class Expect(BaseModel):
    """What a conforming implementation produces at one step."""

    model_config = _FROZEN

    status: Literal["applied", "refused"]
    refusal: RefusalReason | None = Field(
        default=None,
        description="why a refusal happened; with status applied: a prefill's early "
        "reservation was refused (the node exists, not reserved)",
    )
    returned: Returned | None = None
    owners: list[int] | None = Field(
        default=None, description="CP prefill: the owner rank of each page of the new node"
    )
    drained: AckRows = Field(default_factory=AckRows)
    queued: AckRows = Field(default_factory=AckRows)
    held: list[Holding]
    bytes: list[CopyBytes] = Field(default_factory=list)


class VectorStep(BaseModel):
    """One step: the rule, its concrete arguments, and what must follow."""

    model_config = _FROZEN

    op: RuleName
    args: dict[str, StepArg] = Field(default_factory=dict)
    expect: Expect
    inv: InvId | None = Field(
        default=None, description="the invariant this step's expectation guards (stories)"
    )
    note: str = ""


class Acked(BaseModel):
    """The node ids whose write (backup) or load an ack completed, sorted."""

    model_config = _FROZEN

    write: list[int] = Field(default_factory=list)
    load: list[int] = Field(default_factory=list)


class Final(BaseModel):
    """Quiescence: the forward finishes, every stream runs dry, both queues drain."""

    model_config = _FROZEN

    acked: Acked = Field(description="what the quiescence drains completed")
    held: list[Holding]
    bytes: list[CopyBytes]


class Vector(BaseModel):
    """One conformance vector."""

    model_config = _FROZEN

    format_version: Literal["hicache-vector/1"] = FORMAT_VERSION
    suite: str
    id: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    title: str
    kind: Literal["story", "generated", "oracle"]
    invariants: list[InvId]
    rules: list[RuleName]
    requires: list[str] = Field(
        description="capabilities a step needs beyond what the configuration implies"
    )
    schedule: Schedule
    config: HarnessConfig
    components: dict[str, list[int]] = Field(
        description="the target pool's components, in transfer order, and each one's row shape"
    )
    steps: list[VectorStep]
    final: Final
    digest: Digest = Field(description="compute_digest of this vector without this field")


class SuiteHeader(BaseModel):
    """The first line of a suite file."""

    model_config = _FROZEN

    format_version: Literal["hicache-vector/1"] = FORMAT_VERSION
    suite: str
    seed: int
    vectors: int = Field(ge=0)
    digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] = Field(
        description="sha256 of the vectors' digests, one per line, in file order"
    )
    generator: str = Field(description="what wrote it (hicache_ref and its version)")


def canonical_json(data: object) -> str:
    """The one serialization digests are computed over: sorted keys, no spaces."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def compute_digest(vector: Vector | dict[str, object]) -> str:
    """The first 16 hex digits of sha256 over the vector's canonical JSON without ``digest``."""
    data = vector.model_dump(mode="json") if isinstance(vector, Vector) else dict(vector)
    data.pop("digest", None)
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()[:16]


def compute_suite_digest(digests: list[str]) -> str:
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()
