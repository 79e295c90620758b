"""The CP process group: one ``torch.distributed`` group per spawned world, object collectives
only, and a timeout on every one of them.

Every process the harness starts (the parent before it spawns, each rank again on entry) sets
``PROCESS_ENV``: NVLink multicast (NVLS, symmetric-memory multicast) stays off, so an NCCL world
on a shared GPU host never asks for it. Ranks meet through a file store in a folder the parent
owns (no port to pick, no port to collide); ``init_process_group``'s ``timeout`` bounds every
collective, so a rank that never arrives fails the others instead of hanging them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal, TypeVar, cast

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = ("gloo", "nccl")
PROCESS_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
COLLECTIVE_TIMEOUT_S = 60.0
T = TypeVar("T")


def apply_process_env() -> None:
    """Switch NVLink multicast off in this process (and the children it starts)."""
    os.environ.update(PROCESS_ENV)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the CP world, and the two collectives the harness uses."""

    rank: int
    world_size: int
    backend: Backend

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (what other ranks pass is ignored)."""
        box: list[object] = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return cast(T, box[0])

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return cast(list[T], out)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def open_group(
    backend: Backend,
    rank: int,
    world_size: int,
    store_file: Path,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> RankGroup:
    """Join the world: one rank per process (and, for NCCL, one GPU per rank)."""
    assert 0 <= rank < world_size, f"rank {rank} outside [0, {world_size})"
    assert timeout_s > 0, f"collectives need a positive timeout, got {timeout_s}"
    apply_process_env()
    if backend == "nccl":
        torch.cuda.set_device(rank)  # object collectives run on the current device
    dist.init_process_group(
        backend,
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return RankGroup(rank, world_size, backend)
