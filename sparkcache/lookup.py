"""Finding the longest restorable prefix of a prompt: SQL over boundary rows.

The prompt's block-boundary hashes are computed once.  Every snapshot has a
boundary row at its end, at every ``alias_stride`` tokens and at its
breakpoints; the stride rows of the snapshots sharing a prompt's first p
tokens exist at every stride position up to p, so the matched stride probes
are a prefix of all of them and a binary search finds the longest (one
primary-key probe each).  The rows at that stride and in the window above it
are read in one query; candidates are checked for restorability (state,
chain, every expected rank) and the longest wins.  docs/architecture.md
("Lookup") has the cost.  A sliding-window model's snapshots restore only
at their ends (``ends_only``; callers pass the identity's ``ends_only``):
those rows are not prefix-closed; the blocks where they may lie are the
first stride's and the ends of the snapshots sharing the first stride
(:func:`_end_blocks`), read in one query.  :func:`extend` grows a match by
the stored block where the prompt leaves it, inside that block.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from sparkcache.core import Conn, Core, Match, scalar, select_all
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.hashing import as_token_array, prefix_hashes, prefix_seed
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.index import queries as q
from sparkcache.reader import stored_tokens

__all__ = ["expected_ranks", "extend", "grow", "lookup"]


def expected_ranks(identity: ModelIdentity, ranks: Iterable[int] | None) -> list[int]:
    """``ranks`` checked and sorted; by default every rank of the topology."""
    expected = sorted({identity.check_rank(r) for r in ranks} if ranks is not None
                      else range(identity.world_size))
    if not expected:
        raise InvalidArgument("ranks must name at least one rank")
    return expected


def lookup(
    core: Core, identity: ModelIdentity, token_ids: Sequence[int] | np.ndarray, *,
    alias_stride: int, scope: RequestScope | None = None, ranks: Iterable[int] | None = None,
    hashes: Sequence[bytes] | None = None, whole_first: bool = False, ends_only: bool = False,
) -> Match | None:
    """The longest stored prefix of ``token_ids`` every rank in ``ranks`` can
    restore, or None; see :meth:`sparkcache.store.SnapshotStore.lookup`."""
    tokens = as_token_array(token_ids)
    expected = expected_ranks(identity, ranks)
    bs = identity.block_size
    if hashes is None:
        hashes = prefix_hashes(prefix_seed(identity, scope), tokens, bs)
    elif len(hashes) != tokens.size // bs:
        raise InvalidArgument("hashes must hold one hash per full block of token_ids")
    n_blocks = len(hashes)
    if n_blocks == 0:
        return None
    stride = max(1, alias_stride // bs)
    ranks_json = json.dumps(expected)
    with core.read() as conn:
        model_id = core.model_id(conn, identity)
        if model_id is None:
            return None
        if ends_only:
            passes = [(_end_blocks(conn, model_id, hashes, stride, bs), q.FIND_ENDS)]
        else:
            probe = list(range(stride - 1, n_blocks, stride))
            matched = _matched_strides(conn, model_id, hashes, probe, bs)
            top = probe[matched - 1] + 1 if matched else 0  # blocks matched at a stride
            window = [i for i in range(top, min(n_blocks, top + stride)) if (i + 1) % stride]
            # Every candidate of top * bs tokens or more has a row at the top stride or
            # in the window; the shorter ones are read only if none of those restores.
            passes = [(probe[matched - 1:matched] + window, q.FIND_BOUNDARIES),
                      (probe[:max(0, matched - 1)], q.FIND_BOUNDARIES)]
        unrestorable = False
        for blocks, query in passes:
            found = _find(conn, model_id, hashes, blocks, bs, query)
            if whole_first and not ends_only:  # at the same length, one ending there first
                ends = {sid: info.n_tokens for sid, _ in found
                        if (info := core.snapshot(conn, sid)) is not None}
                found.sort(key=lambda c: (-c[1], ends.get(c[0]) != c[1], -c[0]))
            else:
                found.sort(key=lambda c: (-c[1], -c[0]))
            for snapshot_id, n in found:
                if restorable(core, conn, snapshot_id, n, ranks_json, len(expected)):
                    return Match(snapshot_id, n, identity, tokens[:n].copy(), scope,
                                 from_lookup=True)
            unrestorable = unrestorable or bool(found)
        if unrestorable:
            core.count(model_id, "misses.unrestorable")
        core.count(model_id, "misses")
    return None


def extend(
    core: Core, match: Match, token_ids: Sequence[int] | np.ndarray, *,
    ranks: Iterable[int] | None = None,
) -> tuple[Match, int] | None:
    """``match`` grown by the snapshot's next stored block when it begins with
    the rest of ``token_ids`` or part of it, and the tokens of ``token_ids``
    it supplies; see :meth:`sparkcache.store.SnapshotStore.extend`."""
    tokens = as_token_array(token_ids)
    identity = match.identity
    bs = identity.block_size
    n = match.n_tokens
    if not n < tokens.size < n + bs:
        raise InvalidArgument(f"token_ids must extend the match by 1 to {bs - 1} tokens "
                              f"(it has {n}), got {tokens.size}")
    if not np.array_equal(tokens[:n], match.token_ids):
        raise InvalidArgument("token_ids must begin with the match's token ids")
    expected = expected_ranks(identity, ranks)
    with core.read() as conn:
        if not restorable(core, conn, match.snapshot_id, n + bs, json.dumps(expected),
                          len(expected)):
            return None
    stored = stored_tokens(core, match, expected[0], n + bs)
    if stored.size < bs:
        return None
    same = stored[:tokens.size - n] == tokens[n:]
    shared = same.size if bool(same.all()) else int(np.argmin(same))
    if shared == 0:
        return None
    return Match(match.snapshot_id, n + bs, identity, np.concatenate([tokens[:n], stored]),
                 match.scope, from_lookup=match.from_lookup), n + shared


def grow(
    core: Core, match: Match, token_ids: Sequence[int] | np.ndarray, *, alias_stride: int,
    ranks: Iterable[int] | None = None,
) -> Match:
    """``match`` grown by the whole blocks after it that its snapshot stores and
    ``token_ids`` share (at most one ``alias_stride`` more); see
    :meth:`sparkcache.store.SnapshotStore.grow`."""
    tokens = as_token_array(token_ids)
    identity = match.identity
    bs = identity.block_size
    n = match.n_tokens
    if tokens.size < n or not np.array_equal(tokens[:n], match.token_ids):
        raise InvalidArgument("token_ids must begin with the match's token ids")
    stop = min(tokens.size // bs * bs, n + max(bs, alias_stride // bs * bs))
    if stop <= n:
        return match
    expected = expected_ranks(identity, ranks)
    with core.read() as conn:
        info = core.snapshot(conn, match.snapshot_id)
        if info is None:
            raise NotFound(f"snapshot {match.snapshot_id} is no longer restorable")
        stop = min(stop, info.n_tokens)
        if stop <= n or not restorable(core, conn, match.snapshot_id, stop,
                                       json.dumps(expected), len(expected)):
            return match
    stored = stored_tokens(core, match, expected[0], stop)
    same = stored == tokens[n:n + stored.size]
    shared = stored.size if bool(same.all()) else int(np.argmin(same))
    grown = n + shared // bs * bs
    if grown == n:
        return match
    return Match(match.snapshot_id, grown, identity, tokens[:grown].copy(), match.scope,
                 from_lookup=match.from_lookup)


def _matched_strides(
    conn: Conn, model_id: int, hashes: Sequence[bytes], probe: list[int], bs: int
) -> int:
    """How many leading stride probes have a boundary row, by binary search.

    Stride rows are prefix-closed: a snapshot sharing the prompt's first p
    tokens has a row at every stride position up to p, so the matched probes
    are a prefix of ``probe``.  log2(len(probe)) point queries, instead of
    reading every row of every snapshot that shares a prefix with the prompt.
    """
    lo, hi = 0, len(probe)
    while lo < hi:
        mid = (lo + hi) // 2
        i = probe[mid]
        if conn.execute(q.HAS_BOUNDARY, (hashes[i], model_id, (i + 1) * bs)).fetchone():
            lo = mid + 1
        else:
            hi = mid
    return lo


def _end_blocks(conn: Conn, model_id: int, hashes: Sequence[bytes], stride: int,
                bs: int) -> list[int]:
    """The blocks where a stored snapshot sharing the prompt may end.

    Ends are not prefix-closed, so no binary search finds them; but a snapshot
    that shares the prompt up to its end at or past the first stride has a
    row at the first stride: the lengths of those snapshots (one query, rows
    per snapshot sharing that stride), and every block of the first stride
    (shorter snapshots have no stride row), instead of a probe per block.
    """
    n_blocks = len(hashes)
    blocks = set(range(min(stride, n_blocks)))
    if n_blocks >= stride:
        first = stride - 1
        rows = select_all(conn, q.LENGTHS_SHARING,
                     (hashes[first], model_id, (first + 1) * bs, n_blocks * bs), into=_Length)
        blocks.update(row.n_tokens // bs - 1 for row in rows)
    return sorted(blocks)


def _find(
    conn: Conn, model_id: int, hashes: Sequence[bytes], blocks: list[int], bs: int,
    query: str = q.FIND_BOUNDARIES,
) -> list[tuple[int, int]]:
    """(snapshot id, n_tokens) of every boundary row at the given block indices
    (``query``: :data:`~sparkcache.index.queries.FIND_ENDS` for snapshot ends only)."""
    if not blocks:
        return []
    position = {hashes[i]: (i + 1) * bs for i in blocks}
    rows = select_all(conn, query, (json.dumps([h.hex() for h in position]), model_id),
                 into=_BoundaryRow)
    # A row's position must agree with where the prompt has that hash.
    return [(row.snapshot_id, row.n_tokens) for row in rows
            if position.get(bytes(row.prefix_hash)) == row.n_tokens]


class _Length(NamedTuple):
    """A row of ``queries.LENGTHS_SHARING``."""

    n_tokens: int


class _BoundaryRow(NamedTuple):
    """A row of ``queries.FIND_BOUNDARIES``."""

    prefix_hash: bytes
    snapshot_id: int
    n_tokens: int


def restorable(core: Core, conn: Conn, snapshot_id: int, n: int, ranks_json: str,
               n_ranks: int) -> bool:
    """Whether every link of the chain holding tokens below ``n`` is ready on
    every rank of ``ranks_json`` (a JSON list of ``n_ranks`` ranks)."""
    for link in core.chain(conn, snapshot_id):
        if link.start >= n:
            continue
        if link.state != "ready":
            return False
        if scalar(conn, q.READY_RANKS, (link.id, ranks_json)) != n_ranks:
            return False
    return True
