"""KVGroups: every model is a list of KV cache groups, a plain model one; the
rules a group's kind decides are its properties and methods."""

from __future__ import annotations

import dataclasses

import pytest

from sparkcache.connector.groups import KVGroups
from sparkcache.errors import InvalidArgument, SparkCacheError
from sparkcache.identity import WINDOW_BLOCKS_KEY

from .helpers import identity

PLAIN, HYBRID = KVGroups(), KVGroups((2, 0))


def test_vllms_block_ids_become_one_list_per_group() -> None:
    assert PLAIN.per_group([3, 4]) == [[3, 4]]  # request_finished: one list
    assert PLAIN.per_group(([3, 4],)) == [[3, 4]]  # get_block_ids(): one per group
    assert HYBRID.per_group(([0, 7], (1, 2))) == [[0, 7], [1, 2]]
    assert HYBRID.per_group([]) == [[], []] and PLAIN.per_group(()) == [[]]
    with pytest.raises(SparkCacheError, match="2 KV cache groups"):
        HYBRID.per_group([3, 4])
    with pytest.raises(InvalidArgument):
        KVGroups(())


def test_the_rules_of_each_kind() -> None:
    assert PLAIN.plain and not PLAIN.ends_only and PLAIN.copy_on_write
    assert not PLAIN.fails_by_request
    assert HYBRID.ends_only and not HYBRID.copy_on_write and HYBRID.fails_by_request
    assert KVGroups((0, 0)).fails_by_request and not KVGroups((0, 0)).ends_only
    assert PLAIN.copy_in_step(mid_request=True) == ()
    assert HYBRID.copy_in_step(mid_request=True) == (0,)
    assert HYBRID.copy_in_step(mid_request=False) == ()
    # A breakpoint's block is saved whole where the prompt fills it (restored
    # into it later); with a window, or in the prompt's last block, the whole
    # blocks below it.
    assert [PLAIN.mark_end(m, 16, 100) for m in (40, 64, 70, 100)] == [48, 64, 80, 96]
    assert [HYBRID.mark_end(m, 16, 100) for m in (40, 64, 70, 100)] == [32, 64, 64, 96]
    assert PLAIN.save_ends([48, 80, 96]) == [96]  # one snapshot, the rest aliases
    assert HYBRID.save_ends([32, 64, 96, 64]) == [32, 64, 96]  # one each
    assert PLAIN.prompt_end(99, 16) is None and HYBRID.prompt_end(99, 16) == 96


def test_a_window_keeps_its_last_blocks_and_skips_vllms_null_block() -> None:
    groups = HYBRID.per_group(([0, 0, 0, 0, 0, 20, 21], list(range(1, 8))))
    blocks = HYBRID.blocks(groups, 0, 7)
    assert blocks == ((20, 21), tuple(range(1, 8)))
    assert not HYBRID.window_gone(blocks, 0, 7)
    assert HYBRID.blocks(HYBRID.per_group(([0] * 6 + [21], [1] * 7)), 0, 7)[0] == (21,)
    assert HYBRID.window_gone(((21,), tuple(range(1, 8))), 0, 7)  # freed already
    assert PLAIN.blocks([[0, 1, 2, 3]], 1, 4) == ((1, 2, 3),)  # id 0 is a block here
    assert not PLAIN.window_gone(((0, 1),), 0, 2)
    assert HYBRID.bad_load(((0, 5), (1, 2))) and HYBRID.bad_load(((), (1, 2)))
    assert not PLAIN.bad_load(((0, 1),))


def test_the_identity_asks_the_same_question() -> None:
    assert not identity().ends_only
    windowed = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, "2,0"),))
    assert windowed.ends_only
    assert not dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, "0,0"),)).ends_only
