"""The shared tier's layout: keys from digests only, deterministic objects, strict parsers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.backends import validate_key
from sparkcache.errors import InvalidArgument
from sparkcache.identity import RequestScope
from sparkcache.shared.layout import (
    Alias,
    Manifest,
    SegmentEntry,
    alias_blocks,
    alias_bytes,
    alias_key,
    manifest_bytes,
    manifest_key,
    model_key,
    parse_alias,
    parse_manifest,
    parse_tier,
    segment_key,
    tier_bytes,
)

MODEL = "0123456789abcdef0123456789abcdef"
KEY = "fedcba9876543210fedcba9876543210"
PARENT = "00112233445566778899aabbccddeeff"
DIGEST = "ab" * 16


def manifest(**changes: object) -> Manifest:
    fields: dict[str, object] = dict(
        model=MODEL, snap_key=KEY, n_tokens=64, start_token=32, parent=PARENT,
        scope=RequestScope(cache_salt="s"), breakpoints=(8, 48), world_size=2,
        segments=tuple(SegmentEntry(r, segment_key(MODEL, KEY, r, DIGEST), 100 + r, DIGEST,
                                    32, 64) for r in range(2)),
        aliases=((48, "11" * 16), (64, KEY)))
    fields.update(changes)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_keys_are_made_of_digests_and_valid() -> None:
    keys = [model_key(MODEL), segment_key(MODEL, KEY, 3, DIGEST), manifest_key(MODEL, KEY),
            alias_key(MODEL, PARENT)]
    assert keys == [
        f"m-{MODEL}/model.json",
        f"m-{MODEL}/seg/fe/{KEY}.r3.{DIGEST}.safetensors",
        f"m-{MODEL}/snap/fe/{KEY}.json",
        f"m-{MODEL}/at/00/{PARENT}.json",
    ]
    for key in keys:
        assert validate_key(key) == key
    with pytest.raises(InvalidArgument, match="hex"):
        manifest_key(MODEL, "../../etc")
    with pytest.raises(InvalidArgument, match="hex"):
        segment_key("M" * 32, KEY, 0, DIGEST)


def test_alias_blocks_are_the_strides_and_breakpoints_of_the_link() -> None:
    # blocks [4, 20) of a chain, a stride of 4 blocks: boundaries 8, 12, 16, 20 (the end)
    assert alias_blocks(4, 20, 4) == [7, 11, 15, 19]
    assert alias_blocks(0, 10, 4) == [3, 7]  # the end (10 blocks) is not on a stride
    # breakpoints (in blocks) inside the link only; the parent's upload had the others
    assert alias_blocks(4, 10, 4, breakpoints=[2, 5, 10, 11]) == [4, 7, 9]
    assert alias_blocks(0, 3, 0) == [0, 1, 2]  # a stride below one block: every block


@given(st.integers(0, 50), st.integers(1, 80), st.integers(1, 9))
def test_alias_blocks_match_the_local_index(start: int, n: int, stride: int) -> None:
    """The aliases of a chain, link by link, are the local index's stride rows."""
    if start >= n:
        return
    blocks = alias_blocks(0, start, stride) + alias_blocks(start, n, stride)
    assert blocks == [i for i in range(stride - 1, n, stride)]


def test_manifest_round_trip_and_deterministic_bytes() -> None:
    m = manifest()
    raw = manifest_bytes(m)
    assert raw == manifest_bytes(manifest())  # no time, no host: the same bytes anywhere
    assert parse_manifest(raw, MODEL, KEY) == m
    assert m.nbytes == 201
    root = manifest(start_token=0, parent=None, aliases=(), segments=tuple(
        SegmentEntry(r, segment_key(MODEL, KEY, r, DIGEST), 9, DIGEST, 0, 64) for r in range(2)))
    assert parse_manifest(manifest_bytes(root), MODEL, KEY).parent is None


@pytest.mark.parametrize("change", [
    {"model": PARENT}, {"snap_key": PARENT}, {"version": 99}, {"format": "x"},
    {"parent": None}, {"start_token": 64}, {"world_size": 3}, {"n_tokens": True},
    {"breakpoints": [48, 8]}, {"breakpoints": [64]}, {"scope": {"cache_salt": 1}},
    {"aliases": [[65, KEY]]}, {"aliases": [[1, "x"]]}, {"extra": 1},
])
def test_a_bad_manifest_is_refused(change: dict[str, object]) -> None:
    doc = json.loads(manifest_bytes(manifest()))
    doc.update(change)
    with pytest.raises(InvalidArgument, match="manifest"):
        parse_manifest(json.dumps(doc).encode(), MODEL, KEY)


@pytest.mark.parametrize("change", [
    {"rank": 1}, {"key": f"m-{MODEL}/seg/fe/{KEY}.r0.{'cd' * 16}.safetensors"},
    {"key": "../x"}, {"nbytes": 0}, {"token_start": 0}, {"digest": "X" * 32},
])
def test_a_bad_segment_entry_is_refused(change: dict[str, object]) -> None:
    doc = json.loads(manifest_bytes(manifest()))
    doc["segments"][0].update(change)
    with pytest.raises(InvalidArgument, match="segment of rank 0"):
        parse_manifest(json.dumps(doc).encode(), MODEL, KEY)


def test_not_json_and_too_big_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_manifest(b"\x80{", MODEL, KEY)
    with pytest.raises(InvalidArgument, match="not a JSON object"):
        parse_manifest(b"[1]", MODEL, KEY)
    with pytest.raises(InvalidArgument, match="bytes"):
        parse_manifest(b" " * (5 << 20), MODEL, KEY)


def test_alias_round_trip() -> None:
    alias = Alias(PARENT, 48, KEY, 64)
    assert parse_alias(alias_bytes(alias), PARENT) == alias
    with pytest.raises(InvalidArgument, match="not a sparkcache alias"):
        parse_alias(alias_bytes(alias), KEY)  # fetched under another hash
    with pytest.raises(InvalidArgument, match="token counts"):
        parse_alias(alias_bytes(Alias(PARENT, 65, KEY, 64)), PARENT)


def test_tier_file() -> None:
    assert parse_tier(tier_bytes(256), "s3://b/kv").alias_stride == 256
    with pytest.raises(InvalidArgument, match="not a sparkcache shared tier"):
        parse_tier(b'{"format": "other"}', "s3://b/kv")
    newer = json.dumps({"format": "sparkcache-shared", "version": 2, "alias_stride": 16})
    with pytest.raises(InvalidArgument, match="upgrade sparkcache"):
        parse_tier(newer.encode(), "s3://b/kv")
    bad = json.dumps({"format": "sparkcache-shared", "version": 1, "alias_stride": 0})
    with pytest.raises(InvalidArgument, match="alias_stride"):
        parse_tier(bad.encode(), "s3://b/kv")
