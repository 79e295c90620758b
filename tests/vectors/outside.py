"""A small implementation package outside this repository, written at test time.

``write_outside_package(folder)`` lays out ``outside_impl`` (an adapter over its own controller
classes: the reference's, one with a seeded bug taken from ``fuzz/mutants/extra_write_ack.py``,
and one that broke the contract by renaming ``start_loading``) plus the ``.dist-info`` an
installed package would have, so ``importlib.metadata`` finds its entry points in the
``hicache_ref.implementations`` group once the folder is on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MUTANT_FILE = REPO / "fuzz" / "mutants" / "extra_write_ack.py"
PACKAGE = "outside_impl"

SOURCE = '''"""An implementation someone else wrote, checked against hicache_ref from the outside."""

import importlib.util

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import CAPABILITIES
from hicache_ref.harness.adapters.contract import ImplementationBase

INVARIANTS = ("INV-02",)  # what its seeded bug must be caught by (hicache-fuzz mutants --impl)
MUTANT_FILE = {mutant_file!r}


def _buggy_class():
    spec = importlib.util.spec_from_file_location("outside_buggy", MUTANT_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Controller  # a second write ack for every write (INV-02)


class OutsideImplementation(ImplementationBase):
    capabilities = CAPABILITIES - {{"storage"}}

    def __init__(self, name, controller_class, wrap=None):
        self.name, self.controller_class, self.wrap = name, controller_class, wrap

    def build_controller(self, request):
        controller = self.controller_class(
            request.allocator,
            request.host_pool,
            request.config.page_size,
            io_backend=request.config.io_backend,
            cp_shared_kv_layout=request.cp_layout,
            draft_mem_pool_host=request.draft_host_pool,
            draft_mem_pool_device=request.draft_device_pool,
            device_module=request.device_module,
            num_counters=request.config.num_counters,
        )
        return controller if self.wrap is None else self.wrap(controller)


class _Renamed:
    """The controller with start_loading renamed to begin_loading (a contract break)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "start_loading":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def begin_loading(self):
        return self._inner.start_loading()


def reference():
    return OutsideImplementation("outside-reference", HiCacheController)


def mutant():
    return OutsideImplementation("outside-mutant", _buggy_class())


def renamed():
    impl = OutsideImplementation("outside-renamed", HiCacheController, _Renamed)
    impl.capabilities = frozenset({{"io:direct", "layout:layer_first", "pool:mha"}})
    return impl
'''

ENTRY_POINTS = """[hicache_ref.implementations]
outside-reference = outside_impl:reference
outside-mutant = outside_impl:mutant
"""


def write_outside_package(folder: Path) -> Path:
    """Write the package and its dist-info into ``folder``; returns ``folder``."""
    package = folder / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SOURCE.format(mutant_file=str(MUTANT_FILE)))
    info = folder / f"{PACKAGE}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return folder
