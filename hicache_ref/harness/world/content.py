"""The byte oracle's alphabet: the value every KV row must hold, derived from who wrote it.

A row's value is a pure function of (node content id, target or draft, layer, component,
token position), so a row found anywhere tells where it came from, and a wrong row names the
node, layer and position it was supposed to hold (INV-06). Pools use float64 in the harness so
every value is exact; row element k adds k/1024, so a row shifted inside itself is caught too.
"""

from __future__ import annotations

import functools

import torch

HARNESS_DTYPE = torch.float64
MAX_POSITIONS = 1 << 16


def compute_row_value(uid: int, draft: bool, layer: int, component: int, position: int) -> float:
    """The scalar a KV row starts from; never 0, so an untouched (zeroed) row is always wrong."""
    assert 0 <= position < MAX_POSITIONS and 0 <= component < 8 and 0 <= layer < 64
    base = ((uid * 64 + layer) * 8 + component) * MAX_POSITIONS + position + 1
    return float(-base if draft else base)


def expected_rows(
    uid: int,
    draft: bool,
    layer: int,
    component: int,
    positions: torch.Tensor,
    row_shape: tuple[int, ...],
) -> torch.Tensor:
    """Rows for ``positions`` (one per position) shaped ``(n, *row_shape)``."""
    numel = 1
    for dim in row_shape:
        numel *= dim
    prefix = ((uid * 64 + layer) * 8 + component) * MAX_POSITIONS + 1
    starts = _as_float_positions(positions) + float(prefix)
    if draft:
        starts = -starts  # exact: -(p + prefix), as the scalar form's -base
    return (starts[:, None] + _ramp(numel)[None, :]).reshape(len(starts), *row_shape)


def expected_rows_of_layers(
    uid: int,
    draft: bool,
    layer_num: int,
    component: int,
    positions: torch.Tensor,
    row_shape: tuple[int, ...],
) -> torch.Tensor:
    """``expected_rows`` of layers ``0 .. layer_num - 1`` at once, shaped
    ``(layer_num, n, *row_shape)``: the same values element for element (each is the position
    plus its layer's prefix, negated for a draft, plus the ramp), in a few ops for all layers."""
    assert 0 < layer_num <= 64
    numel = 1
    for dim in row_shape:
        numel *= dim
    prefixes = [
        float(((uid * 64 + layer) * 8 + component) * MAX_POSITIONS + 1)
        for layer in range(layer_num)
    ]
    starts = (
        _as_float_positions(positions)[None, :]
        + torch.tensor(prefixes, dtype=HARNESS_DTYPE)[:, None]
    )
    if draft:
        starts = -starts
    rows = starts[:, :, None] + _ramp(numel)[None, None, :]
    return rows.reshape(layer_num, len(positions), *row_shape)


FLOAT_POSITIONS_MAX = 1024


@functools.lru_cache(maxsize=FLOAT_POSITIONS_MAX)
def _as_float_positions(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` as ``HARNESS_DTYPE``, converted once per tensor (the harness's position
    tensors are never written; a tensor hashes by identity and the cache holds it, so its
    identity stays its own)."""
    return positions.to(HARNESS_DTYPE)


@functools.lru_cache(maxsize=64)
def _ramp(numel: int) -> torch.Tensor:
    """``k / 1024`` for each element k of a row (shared, never written to)."""
    return torch.arange(numel, dtype=HARNESS_DTYPE) / 1024.0


FREED_ROW_VALUE = 0.25
"""What the tree writes into a node's device pages when it frees them (no row value is
fractional at its first element), so a read that runs before the copy into reused pages landed
sees poison, not the stale bytes of the node that held them before."""


def describe_row(value: float) -> str:
    """Decode a row's first element back into (uid, draft, layer, component, position)."""
    if value == 0:
        return "an untouched (zero) row"
    if value == FREED_ROW_VALUE:
        return "the poison of a freed device page (nothing was copied into it yet)"
    draft = value < 0
    base = int(abs(value)) - 1
    position = base % MAX_POSITIONS
    rest = base // MAX_POSITIONS
    component = rest % 8
    rest //= 8
    layer = rest % 64
    uid = rest // 64
    kind = "draft" if draft else "target"
    return f"node-content {uid} {kind} layer {layer} component {component} position {position}"
