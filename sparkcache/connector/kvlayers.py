"""A worker's KV layers as the I/O sees them: each KV cache group's pages.

:class:`Pages` is what the worker's loads and saves need of one group's
layers (``sparkcache.cuda.KVPages``, or a test double); :class:`LayerGroups`
maps the identity's layers, in model order, onto the groups.  Plain data:
no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sparkcache.cuda import StagedRestore

__all__ = ["LayerGroups", "Pages"]


class Pages(Protocol):
    """What the I/O needs of a worker's KV cache (``KVPages`` or a test double)."""

    num_blocks: int
    page_nbytes: int

    def __len__(self) -> int: ...
    def block_views(self, block_ids: Sequence[int]) -> list[list[np.ndarray]] | None: ...
    def fence(self) -> object: ...
    def gather(self, block_ids: Sequence[int], after: object = None) -> list[np.ndarray]: ...
    def scatter(self, block_ids: Sequence[int], pages: Sequence[np.ndarray]) -> None: ...
    def staged(self, block_ids: Sequence[int]) -> StagedRestore: ...


class LayerGroups:
    """A worker's KV layers by KV cache group (a plain model: one group).

    Each group has its own block table, so its layers move through their own
    :class:`Pages`; ``where[i]`` says where the identity's layer ``i`` (model
    order) is: ``(group, index among that group's pages)``.
    """

    def __init__(self, pages: Sequence[Pages], where: Sequence[tuple[int, int]]) -> None:
        self.pages = list(pages)
        self.where = list(where)

    @classmethod
    def one(cls, pages: Pages) -> LayerGroups:
        """A plain model's one group: every layer of ``pages``, in order."""
        return cls([pages], [(0, i) for i in range(len(pages))])
