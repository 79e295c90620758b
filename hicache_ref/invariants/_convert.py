"""Small conversions shared by the checkers: plain ints from tensors or sequences."""

from __future__ import annotations

from collections.abc import Iterable

import torch

IntsLike = Iterable[int] | torch.Tensor
"""Indices as a tensor or any iterable of ints: checkers accept either."""


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU. Checkers read values, so they may synchronize; the hot path must not."""
    return tensor if tensor.is_cpu else tensor.detach().cpu()


def to_ints(values: IntsLike) -> list[int]:
    """``values`` as a list of Python ints (a tensor is flattened and copied to the CPU)."""
    if isinstance(values, torch.Tensor):
        ints: list[int] = to_host(values).flatten().tolist()
        return ints
    return [int(value) for value in values]


def shorten(values: Iterable[object], limit: int = 8) -> str:
    """A list for a message, cut after ``limit`` items."""
    items = list(values)
    shown = ", ".join(str(item) for item in items[:limit])
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"[{shown}{more}]"
