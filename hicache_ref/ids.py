"""Distinct id types, so mypy rejects a device page passed where a host slot is expected."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", int)
"""A radix-tree node id (``TreeNode.id``); strictly increasing until ``reset()``."""

HostSlot = NewType("HostSlot", int)
"""A token slot in a host pool."""

DeviceLoc = NewType("DeviceLoc", int)
"""A token location in a device KV pool (logical under CP)."""

PageId = NewType("PageId", int)
"""A page number: ``loc // page_size``."""

LayerId = NewType("LayerId", int)
"""A layer index local to a pool, ``0 <= layer_id < layer_num``."""

RankId = NewType("RankId", int)
"""A context-parallel rank."""
