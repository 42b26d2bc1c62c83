"""sparkcache.sharding: which heads each rank holds, and what another sharding reads."""

from __future__ import annotations

import pytest

from sparkcache.errors import InvalidArgument, SparkCacheError
from sparkcache.sharding import HeadRead, Sharding, ShardingRefused, plan_reads


@pytest.mark.parametrize(("heads", "tp", "expected"), [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    # More ranks than heads: each head on tp / heads ranks, in order (vLLM's split).
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    (1, 2, [(0, 1), (0, 1)]),
])
def test_each_rank_holds_a_contiguous_slice(heads: int, tp: int,
                                            expected: list[tuple[int, int]]) -> None:
    sharding = Sharding(heads, tp)
    assert [sharding.heads_of(r) for r in range(tp)] == expected
    assert sharding.local_heads == expected[0][1] - expected[0][0]


def test_the_same_sharding_reads_its_own_rank_whole() -> None:
    s = Sharding(4, 2)
    assert plan_reads(s, s, 1) == [HeadRead(1, 0, 0, 2)]


def test_tp2_to_tp1_reads_both_ranks_into_the_halves_of_each_page() -> None:
    assert plan_reads(Sharding(4, 2), Sharding(4, 1), 0) == [
        HeadRead(0, 0, 0, 2), HeadRead(1, 0, 2, 2)]
    # And the byte ranges: 100 bytes a head.
    assert [r.byte_range(100) for r in plan_reads(Sharding(4, 2), Sharding(4, 1), 0)] == [
        (0, 0, 200), (0, 200, 200)]


def test_tp1_to_tp2_each_rank_reads_its_half_of_the_one_segment() -> None:
    assert plan_reads(Sharding(4, 1), Sharding(4, 2), 0) == [HeadRead(0, 0, 0, 2)]
    assert plan_reads(Sharding(4, 1), Sharding(4, 2), 1) == [HeadRead(0, 2, 0, 2)]
    assert plan_reads(Sharding(4, 1), Sharding(4, 2), 1)[0].byte_range(64) == (128, 0, 128)


def test_replicated_heads_are_read_from_the_first_rank_holding_them() -> None:
    # tp=4 over 2 heads: ranks 0,1 hold head 0; ranks 2,3 head 1.
    assert plan_reads(Sharding(2, 4), Sharding(2, 1), 0) == [
        HeadRead(0, 0, 0, 1), HeadRead(2, 0, 1, 1)]
    assert plan_reads(Sharding(2, 1), Sharding(2, 4), 3) == [HeadRead(0, 1, 0, 1)]
    assert plan_reads(Sharding(2, 2), Sharding(2, 4), 1) == [HeadRead(0, 0, 0, 1)]
    assert plan_reads(Sharding(2, 4), Sharding(2, 2), 1) == [HeadRead(2, 0, 0, 1)]


def test_tp4_to_tp2_merges_runs_of_one_rank_only_when_contiguous() -> None:
    assert plan_reads(Sharding(8, 4), Sharding(8, 2), 1) == [
        HeadRead(2, 0, 0, 2), HeadRead(3, 0, 2, 2)]
    assert plan_reads(Sharding(8, 2), Sharding(8, 4), 3) == [HeadRead(1, 2, 0, 2)]


@pytest.mark.parametrize(("stored", "engine", "why"), [
    (Sharding(4, 2, mla=True), Sharding(4, 1, mla=True), "MLA"),
    (Sharding(4, 2, dcp=2), Sharding(4, 2), "decode context"),
    (Sharding(4, 1), Sharding(4, 2, dcp=2), "decode context"),
    (Sharding(4, 2, pp=2), Sharding(4, 1), "pipeline"),
    (Sharding(6, 1), Sharding(6, 4), "do not divide"),
    (Sharding(6, 4), Sharding(6, 1), "do not divide"),
    (Sharding(4, 1), Sharding(2, 1), "another model"),
])
def test_unsupported_pairs_are_refused_saying_why(stored: Sharding, engine: Sharding,
                                                  why: str) -> None:
    with pytest.raises(ShardingRefused, match=why) as info:
        plan_reads(stored, engine, 0)
    assert isinstance(info.value, SparkCacheError)  # a clean miss, never a crash


def test_an_equal_sharding_of_mla_or_dcp_still_reads_its_own_rank() -> None:
    for s in (Sharding(1, 2, mla=True), Sharding(4, 2, dcp=2), Sharding(4, 2, pp=2)):
        assert plan_reads(s, s, 1) == [HeadRead(1, 0, 0, s.local_heads)]


def test_bad_arguments_are_invalid() -> None:
    with pytest.raises(InvalidArgument):
        Sharding(0, 1)
    with pytest.raises(InvalidArgument):
        Sharding(4, 2).heads_of(2)
    with pytest.raises(ShardingRefused):
        Sharding(6, 4).heads_of(0)
    assert "tp=2" in Sharding(4, 2).describe()
