"""The pool API's Python per layer of an H2D load, without a GPU: what ``batch`` costs the caller
before the native issue (issue 30).

``HostKVCache.load_to_device_per_layer`` on the ``batch`` path runs this package's Python (layer
check, copy path, plan and closure lookups, the launch's meta) and then hands one closure to
``device_module.launch``; on CUDA that closure queues the layer's descriptor row on the native
issuing thread (``copy_engine.issue_rows``, ~5 us on the H200 runner, not measured here). This
script builds CPU pools (random pages, bf16, ``layer_first``, CPU index tensors, the shapes of
``benchmarks/transfer.py``) on a device whose ``launch`` only counts the closure, so what it times
is exactly the Python in front of the issue:

- ``same pair again``: one ``load_to_device_per_layer`` of a pair whose every layer was loaded
  before (what ``benchmarks/transfer.py`` times on the runner: it loads the same tensors each
  repetition), over ``--reps`` passes of every layer;
- ``layers 1..L-1 of a new pair``: what the controller pays, each load batch being a new pair
  whose layers are loaded once each;
- ``layer 0 of a new pair``: the per-operation work (index checks, plan, descriptor table).

``time.perf_counter_ns`` around each call, medians.

``--trees A B ...`` times each source tree (a checkout's root, e.g. ``/work/main`` or a
``git worktree`` of the commit before) in its own child process with ``PYTHONPATH`` set to it,
children interleaved over ``--rounds`` so both see the same machine load; the table gives the
median of the rounds' medians. Without ``--trees``: this script's own tree only.

    python benchmarks/copy_issue_cpu.py --trees /path/to/before .
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

CASES = ("mla", "mha")


class IssueStub:
    """A CPU device whose ``launch`` counts the closure instead of running it (the native issue
    is what it stands for)."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.pin_memory = False
        self.launches = 0

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: str = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        del fn, label, kind, meta
        self.launches += 1


def measure(rows: str, tokens: int, layers: int, page: int, reps: int) -> dict[str, float]:
    """Median ns per warm layer and per first layer of a fresh pair, for one row kind."""
    import torch

    from hicache_ref.pools import MHATokenToKVPool, MLATokenToKVPool, make_host_pool

    stub = IssueStub()
    device = cast(Any, stub)
    pages = tokens // page
    size = 2 * pages * page
    if rows == "mla":
        device_pool: Any = MLATokenToKVPool(size, page, torch.bfloat16, 512, 64, layers, device)
    else:
        device_pool = MHATokenToKVPool(size, page, torch.bfloat16, 4, 128, layers, device)
    host_pool = make_host_pool(
        device_pool, layout="layer_first", size_tokens=size, copy_path="batch"
    )
    generator = torch.Generator().manual_seed(1234 + page)
    host_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    device_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    offsets = torch.arange(page, dtype=torch.int64)

    def locs(page_ids: torch.Tensor) -> torch.Tensor:
        return (page_ids[:, None] * page + offsets).reshape(-1)

    host_indices, device_indices = locs(host_pages), locs(device_pages)
    load = host_pool.load_to_device_per_layer
    clock = time.perf_counter_ns
    for layer in range(layers):  # warm-up: the plan and every layer's closure built
        load(device_pool, host_indices, device_indices, layer, "kernel")
    warm: list[int] = []
    for _ in range(reps):
        for layer in range(layers):
            start = clock()
            load(device_pool, host_indices, device_indices, layer, "kernel")
            warm.append(clock() - start)
    first: list[int] = []
    fresh: list[int] = []
    pairs = max(10, reps // 5)
    for _ in range(pairs):
        # a new pair, as each load batch of the controller is: layer 0 validates and plans it,
        # the later layers reuse that work
        fresh_host, fresh_device = host_indices.clone(), device_indices.clone()
        start = clock()
        load(device_pool, fresh_host, fresh_device, 0, "kernel")
        first.append(clock() - start)
        for layer in range(1, layers):
            start = clock()
            load(device_pool, fresh_host, fresh_device, layer, "kernel")
            fresh.append(clock() - start)
    # Verify every call reached the launch (a refused or skipped call times nothing)
    assert stub.launches == layers * (reps + 1 + pairs), stub.launches
    return {
        "per_layer_ns": statistics.median(warm),
        "fresh_layer_ns": statistics.median(fresh),
        "first_layer_ns": statistics.median(first),
    }


def child(args: argparse.Namespace) -> int:
    import hicache_ref

    result = {
        "tree": str(Path(hicache_ref.__file__).resolve().parent.parent),
        "cases": {
            rows: measure(rows, args.tokens, args.layers, args.page_size, args.reps)
            for rows in CASES
        },
    }
    print(json.dumps(result))
    return 0


def run_tree(tree: str, argv: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, __file__, "--child", *argv],
        env=env,
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    # Verify the child imported the tree it was meant to time
    assert Path(str(result["tree"])) == Path(tree).resolve(), (result["tree"], tree)
    return result


def describe_tree(tree: str) -> str:
    """``tree (commit)``, ``+`` where its package differs from that commit."""
    git = ["git", "-C", tree]
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "hicache_ref"], capture_output=True, text=True
    ).stdout.strip()
    return f"{tree} ({head or 'no git'}{'+' if dirty else ''})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    passed = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("tokens", "layers", "page_size", "reps")
    ]
    samples: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            result = run_tree(tree, passed)
            for rows, numbers in result["cases"].items():  # type: ignore[attr-defined]
                for name, value in numbers.items():
                    samples.setdefault((tree, rows, name), []).append(value)
    print(f"Command: `python benchmarks/copy_issue_cpu.py {' '.join(argv)}`")
    print(
        f"{args.tokens} tokens x {args.layers} layers, page {args.page_size}, layer_first, "
        f"copy_path batch, launch stubbed; median of {args.rounds} rounds' medians"
    )
    print()
    print(
        "| tree | rows | per layer, same pair again µs | per layer 1..L-1 of a new pair µs "
        "| layer 0 of a new pair µs |"
    )
    print("|---|---|---:|---:|---:|")
    for tree in args.trees:
        for rows in CASES:
            warm = statistics.median(samples[(tree, rows, "per_layer_ns")]) / 1e3
            fresh = statistics.median(samples[(tree, rows, "fresh_layer_ns")]) / 1e3
            first = statistics.median(samples[(tree, rows, "first_layer_ns")]) / 1e3
            print(f"| {describe_tree(tree)} | {rows} | {warm:.2f} | {fresh:.2f} | {first:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
