"""The implementation contract (``adapters/contract.py``): a break is one ``ContractError``
naming the hook and the fix, raised before any case runs, never a finding."""

from __future__ import annotations

from typing import Any

import pytest

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import BuildRequest
from hicache_ref.harness.adapters.contract import (
    AdoptedImplementation,
    ContractError,
    ImplementationBase,
    adopt,
    check_contract,
)
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.world.config import HarnessConfig


class _DuckTyped:
    """An implementation that does not subclass the base: only the required hooks."""

    name = "duck"
    capabilities = frozenset({"io:direct", "layout:layer_first", "pool:mha"})

    def build_controller(self, request: BuildRequest) -> Any:
        return ReferenceImplementation().build_controller(request)


def test_an_object_with_the_required_hooks_is_adopted_with_the_default_optional_ones() -> None:
    adopted = adopt(_DuckTyped(), "duck")
    assert isinstance(adopted, AdoptedImplementation)
    config = HarnessConfig()
    assert adopted.refine_config(config) is config and adopted.source_tree == ""
    check_contract(adopted)  # its controller has every method and attribute


def test_a_missing_required_hook_names_it() -> None:
    class NoBuild:
        name = "no-build"
        capabilities = frozenset({"pool:mha"})

    with pytest.raises(ContractError, match="has no 'build_controller'"):
        adopt(NoBuild(), "pkg:no_build")


def test_an_unknown_capability_names_the_legal_ones() -> None:
    duck = _DuckTyped()
    duck.capabilities = frozenset({"pool:mha", "teleport"})
    with pytest.raises(ContractError, match=r"unknown capabilities \['teleport'\]; legal: cp"):
        adopt(duck, "duck")


def test_a_declared_capability_the_class_lacks_is_a_contract_error() -> None:
    class WithoutCp(HiCacheController):
        reserve_write_cp = None  # type: ignore[assignment]

    class Claims(ReferenceImplementation):
        name = "claims-cp"
        controller_class = WithoutCp

    with pytest.raises(
        ContractError, match="declares capability 'cp' but WithoutCp has no reserve_write_cp"
    ):
        check_contract(Claims())


def test_a_controller_without_a_contract_method_is_refused_before_any_case() -> None:
    class Broken(ImplementationBase):
        name = "broken"
        capabilities = frozenset({"io:direct", "layout:layer_first", "pool:mha"})

        def build_controller(self, request: BuildRequest) -> Any:
            controller = ReferenceImplementation().build_controller(request)
            return type(
                "NoReset",
                (),
                {"__getattr__": lambda s, n: None if n == "reset" else getattr(controller, n)},
            )()

    with pytest.raises(ContractError, match=r"has no method reset\(\)"):
        check_contract(Broken())
