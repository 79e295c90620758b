"""The one seam between the state machines and an implementation under test.

An ``Implementation`` declares what it supports (``capabilities``) and builds one controller per
simulated rank from pools the harness made. The machines draw only configurations the target
supports and then drive it through the seed's public API (``ControllerLike``), so our reference,
its seeded mutants, upstream SGLang's controller and an optimized rewrite each plug in through a
small file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hicache_ref.device.protocol import DeviceModule
from hicache_ref.harness.config import HarnessConfig

CAPABILITIES = frozenset(
    {
        "cp",  # reserve_write_cp / load_cp / evict_cp_host over a CpSharedKVLayout
        "draft",  # attach_draft_pool: draft transfers ride along
        "per_layer_write",  # submit_write_cp_per_layer(catch_up_all_layers=False) + on_layer_end
        "storage",  # attach_storage_backend / prefetch / write_storage
        "io:direct",
        "io:kernel",
        "layout:layer_first",
        "layout:page_first",
        "layout:page_first_direct",
        "pool:mha",
        "pool:mla",
        "pool:nsa",
        "guards",  # refuses unsafe calls (free in flight, second backup) with the invariant id
    }
)


class AckLike(Protocol):
    finish_event: Any
    node_ids: list[int]


class ControllerLike(Protocol):
    """The seed API surface the harness drives (what SGLang's radix cache calls)."""

    ack_write_queue: list[Any]
    ack_load_queue: list[Any]
    layer_done_counter: Any

    def write(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any: ...
    def start_writing(self) -> None: ...
    def load(
        self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> Any: ...
    def start_loading(self) -> int: ...
    def evict_device(self, device_indices: torch.Tensor) -> int: ...
    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int: ...
    def reset(self) -> None: ...


@dataclass(frozen=True)
class BuildRequest:
    """Everything an implementation needs to build the controller of one rank."""

    config: HarnessConfig
    rank: int
    device_module: DeviceModule
    allocator: Any
    host_pool: Any
    cp_layout: Any | None
    draft_device_pool: Any | None
    draft_host_pool: Any | None


class Implementation(Protocol):
    """An implementation under test."""

    name: str
    capabilities: frozenset[str]

    def build_controller(self, request: BuildRequest) -> ControllerLike: ...


@dataclass(frozen=True)
class Unsupported:
    reasons: Sequence[str] = field(default_factory=tuple)


def unsupported_reasons(capabilities: frozenset[str], config: HarnessConfig) -> list[str]:
    """Why ``config`` is outside ``capabilities`` (empty when it is supported)."""
    needed = {f"io:{config.io_backend}", f"layout:{config.layout}", f"pool:{config.pool_kind}"}
    if config.uses_cp:
        needed.add("cp")
    if config.has_draft:
        needed.add("draft")
    return sorted(needed - capabilities)


def supports(capabilities: frozenset[str], config: HarnessConfig) -> bool:
    return not unsupported_reasons(capabilities, config)
