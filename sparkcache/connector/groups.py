"""A model's KV cache groups and the rules that follow from their kinds.

Every model is a list of KV cache groups (vLLM's hybrid allocator); a plain
model is one full-attention group.  Blocks move one block-id list per group
everywhere inside the connector: vLLM's shapes are normalised once, at the
scheduler side's entry points (:meth:`KVGroups.per_group`).  A group keeps
either every block (full attention) or a window of blocks ending at a
snapshot's end (sliding-window attention); docs/connector.md ("Several KV
cache groups") says what a snapshot stores of each kind.  Plain data: no
vLLM, no store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkcache.errors import InvalidArgument, SparkCacheError

__all__ = ["NULL_BLOCK", "KVGroups"]

#: vLLM's null block: it stands in a window group's list where the window moved past.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroups:
    """The groups' windows: ``windows[g]`` is how many blocks ending at a
    snapshot's end group ``g`` keeps (0: every block).  ``KVGroups()`` is a
    plain model.  Each rule below is decided here and nowhere else."""

    windows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        windows = tuple(int(w) for w in self.windows)
        if not windows or any(w < 0 for w in windows):
            raise InvalidArgument(f"KV cache groups need one window (>= 0) each, got {windows}")
        object.__setattr__(self, "windows", windows)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def plain(self) -> bool:
        """One full-attention group: vLLM's block ids are then unambiguous."""
        return self.windows == (0,)

    @property
    def ends_only(self) -> bool:
        """A group keeps a window: a snapshot restores only at its end (its window
        is stored there alone), so lookups match snapshot ends only."""
        return any(self.windows)

    @property
    def copy_on_write(self) -> bool:
        """Whether a save may name a stored prefix as its parent and write the
        tail only: not when a window must be stored whole below every end."""
        return not self.ends_only

    @property
    def fails_by_request(self) -> bool:
        """Whether vLLM hears of a failed load as a failed request
        (``failed_recving``), not as block ids, which are per group here; only an
        asynchronous load can report that, so loads are asynchronous then."""
        return not self.plain

    def per_group(self, block_ids: Any) -> list[list[int]]:
        """vLLM's block ids as one list per group: ``block_ids`` is one list of
        ids (a plain model's ``request_finished``) or one list per group
        (``get_block_ids()``, ``request_finished_all_groups``).  Empty: no
        blocks in any group.  SparkCacheError when the group count differs."""
        ids = list(block_ids)
        if not ids:
            return [[] for _ in self.windows]
        if hasattr(ids[0], "__index__"):
            ids = [ids]  # one list of ids: one group
        groups = [list(map(int, g)) for g in ids]
        if len(groups) != len(self.windows):
            raise SparkCacheError(f"vLLM passed {len(groups)} block lists for "
                                  f"{len(self.windows)} KV cache groups")
        return groups

    def first_block(self, group: int, start: int, end: int) -> int:
        """The first block of ``[start, end)`` group ``group`` keeps: ``start``,
        or a window's first block below ``end``."""
        keep = self.windows[group]
        return start if keep == 0 else max(start, end - keep)

    def blocks(self, groups: Sequence[Sequence[int]], start: int,
               end: int) -> tuple[tuple[int, ...], ...]:
        """Per group, the ids of the blocks it moves of ``[start, end)``, which end
        at ``end`` (so the group's first block is ``end - len(ids)``): a window
        group only its window, less the null blocks vLLM left at its front
        (outside what attention reads)."""
        out = []
        for g, ids in enumerate(groups):
            first = self.first_block(g, start, end)
            while self.windows[g] and first < end and ids[first] == NULL_BLOCK:
                first += 1
            out.append(tuple(ids[first:end]))
        return tuple(out)

    def window_gone(self, blocks: Sequence[Sequence[int]], start: int, end: int) -> bool:
        """Whether vLLM already freed part of a window a snapshot of blocks
        ``[start, end)`` must hold (:meth:`blocks`' result): nothing is saved."""
        return any(keep and (NULL_BLOCK in ids or len(ids) < min(keep, end - start))
                   for ids, keep in zip(blocks, self.windows, strict=True))

    def bad_load(self, blocks: Sequence[Sequence[int]]) -> bool:
        """Whether a load's blocks leave a group with nothing to restore into, or
        put a window into vLLM's null block (a planning error: the load fails)."""
        return any(not ids or (keep and NULL_BLOCK in ids)
                   for ids, keep in zip(blocks, self.windows, strict=True))

    def copy_in_step(self, *, mid_request: bool) -> tuple[int, ...]:
        """The groups whose blocks a save copies before the step ends: a running
        request's window blocks (vLLM frees them on the next step as the
        request moves on); a finished request's are held until copied."""
        return tuple(g for g, w in enumerate(self.windows) if w) if mid_request else ()

    def mark_end(self, mark: int, block_size: int, prompt_tokens: int) -> int:
        """The snapshot end (whole blocks) that saves the breakpoint ``mark``:
        the end of the block holding it when the prompt fills that block, so a
        later prompt restores up to the mark exactly (into that block); with a
        window, or in the prompt's last partial block, the whole blocks below."""
        up = -(-mark // block_size) * block_size
        return up if up <= prompt_tokens and not self.ends_only else mark // block_size * block_size

    def save_ends(self, ends: Iterable[int]) -> list[int]:
        """The snapshot ends that save the breakpoints ending at ``ends``
        (:meth:`mark_end`) in one step: one snapshot up to the last, the others
        its aliases; with a window, stored at a snapshot's end only, one each."""
        ordered = sorted(set(ends))
        return ordered if self.ends_only else ordered[-1:]

    def prompt_end(self, restorable: int, block_size: int) -> int | None:
        """A model's own save point besides the breakpoints: with a window, the
        prompt's last whole block below ``restorable`` tokens (where the same
        prompt sent again restores; elsewhere the finished request's snapshot
        holds it as an alias).  None for other models."""
        return restorable // block_size * block_size if self.ends_only else None
