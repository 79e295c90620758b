"""The tree's storage existence beliefs, over the reference controller (buffer mode).

In a ``buffer_only`` world (``HarnessConfig.storage_buffer_only``) the harness's tree half
(``harness/driver/storage_buffer.py``) drives each rank's beliefs as SGLang's buffer pipeline
does, and keys a chain's pages with the tree's own hash; it finds both on the controller, as
``harness_beliefs`` and ``_harness_page_keys`` (upstream's: ``adapters/sglang_buffer.py``).
``with_tree_beliefs(cls)`` is ``cls`` with both:

- ``harness_beliefs``: the beliefs the reference controller holds for the tree in buffer mode
  (``controller/storage/existence_beliefs.py``, built from its ``existence_beliefs_class``, so
  a mutant's class keeps its mutation);
- ``_harness_page_keys``: the page keys the tier computes for a chain (the keys a write stores
  and a query asks).

INV-41 judges the beliefs against the harness's own record of the world, never against them.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.existence_beliefs import StorageExistenceBeliefs
from hicache_ref.storage.hashing import Token


def with_tree_beliefs(cls: type[HiCacheController]) -> type[HiCacheController]:
    """``cls`` that hands the tree half its beliefs and page keys (a subclass built per call:
    a mutant keeps its mutation, and no class is kept between worlds)."""

    class TreeBelieving(cls):  # type: ignore[valid-type, misc]
        @property
        def harness_beliefs(self) -> StorageExistenceBeliefs | None:
            beliefs: StorageExistenceBeliefs | None = self.storage_existence_cache
            return beliefs

        def _harness_page_keys(
            self, tokens: Sequence[Token], prior: str | None, page: int
        ) -> list[str]:
            # Verify the tree pages a chain as the controller does
            assert page == self.page_size
            keys: list[str] = self.storage.compute_page_keys(tokens, prior)
            return keys

    TreeBelieving.__name__ = cls.__name__
    TreeBelieving.__qualname__ = cls.__qualname__
    return TreeBelieving
