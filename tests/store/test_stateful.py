"""SnapshotStore against a plain-Python model, in any order hypothesis finds.

The machine publishes prompts built from a few shared chunks (so prefixes
overlap), extends ready snapshots copy-on-write, looks up, reads, deletes,
evicts, pins, leases and reopens the store.  The model is plain Python: which
snapshots exist, their tokens, parent, depth, breakpoints and an LRU tick.

What ``lookup`` must return is modelled exactly: the store only answers at
boundary rows, i.e. a snapshot's end, every ``alias_stride`` tokens rounded
down to whole blocks, and its breakpoints.  So the expected length is the
largest boundary of any snapshot that lies within the prompt's common prefix
with that snapshot.  Two identities run side by side: block 4 (aliases every
16 tokens) and block 6 (the stride rounds down to 12 tokens).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sparkcache import SnapshotStore
from sparkcache.errors import LeaseError
from sparkcache.identity import ModelIdentity

from .helpers import LAYERS, identity, pages_for

STRIDE = 16
MAX_CHAIN = 3
IDENTS: tuple[ModelIdentity, ...] = (identity(), identity(block_size=6, model="tiny-b6"))
# Shared pieces: prompts glued from them share prefixes and diverge mid-block.
CHUNKS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4),
    (1, 2, 3, 4, 5, 6, 7, 8),
    (1, 2, 9),
    (5, 5, 5, 5, 5, 5),
    (10, 11),
    (12, 13, 14, 15, 16, 17, 18, 19),
    (20,),
)
LEASE_TTL = 1e9  # the fake clock never reaches it


def _stride_tokens(ident: ModelIdentity) -> int:
    bs = ident.block_size
    return max(1, STRIDE // bs) * bs


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _arr(toks: tuple[int, ...]) -> np.ndarray:
    return np.asarray(toks, dtype=np.uint32)


@dataclass
class Snap:
    model: int  # index into IDENTS
    tokens: tuple[int, ...]
    parent: int | None  # None for roots and compacted snapshots (no parent row)
    start: int
    depth: int
    marks: frozenset[int]
    last_used: int
    uses: int = 0

    def boundaries(self) -> set[int]:
        n = len(self.tokens)
        stride = _stride_tokens(IDENTS[self.model])
        return {n, *range(stride, n + 1, stride), *self.marks}


class _Clock:
    """Strictly increasing: every event the store stamps gets its own time."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


chunked = st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=8).map(
    lambda parts: tuple(t for part in parts for t in part)
)


def _breakpoints(n: int) -> st.SearchStrategy[list[int]]:
    """Mostly inside the prompt, sometimes below one block, at 0 or past the end."""
    return st.lists(st.integers(-1, n + 8), max_size=2)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="sparkcache-stateful-"))
        self.root = self.base / "store"
        self.clock = _Clock()
        self.store = self._open(fresh=True)
        self.snaps: dict[int, Snap] = {}
        self.pinned: set[int] = set()
        self.leases: dict[int, int] = {}  # lease id -> snapshot id
        self.tick = 0

    def _open(self, *, fresh: bool = False) -> SnapshotStore:
        if fresh:
            return SnapshotStore(self.root, alias_stride=STRIDE, max_chain=MAX_CHAIN,
                                 clock=self.clock)
        return SnapshotStore(self.root, clock=self.clock)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- model helpers ------------------------------------------------------------

    def _next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def _by_tokens(self, model: int, toks: tuple[int, ...]) -> int | None:
        for sid, s in self.snaps.items():
            if s.model == model and s.tokens == toks:
                return sid
        return None

    def _chain(self, sid: int) -> list[int]:
        out: list[int] = []
        cur: int | None = sid
        while cur is not None:
            out.append(cur)
            cur = self.snaps[cur].parent
        return out

    def _touch(self, sid: int, n: int) -> None:
        """What a read of ``n`` tokens of ``sid`` stamps: chain links holding rows below n."""
        t = self._next_tick()
        for link in self._chain(sid):
            if self.snaps[link].start < n:
                self.snaps[link].last_used = t
                self.snaps[link].uses += 1

    def _children(self, sid: int) -> list[int]:
        return [c for c, s in self.snaps.items() if s.parent == sid]

    def _subtree(self, sid: int) -> list[int]:
        out, todo = [], [sid]
        while todo:
            cur = todo.pop()
            out.append(cur)
            todo.extend(self._children(cur))
        return out

    def _forget(self, sid: int) -> None:
        del self.snaps[sid]
        self.pinned.discard(sid)
        for lease, target in list(self.leases.items()):
            if target == sid:
                del self.leases[lease]

    def _expected(self, model: int, prompt: tuple[int, ...]) -> tuple[int, set[int]]:
        """(longest restorable length, snapshot ids that may answer it); (0, set()) = miss."""
        bs = IDENTS[model].block_size
        prompt = prompt[: len(prompt) // bs * bs]
        best, reach = 0, {}
        for sid, s in self.snaps.items():
            if s.model != model:
                continue
            reach[sid] = _common(prompt, s.tokens) // bs * bs
            fits = [b for b in s.boundaries() if b <= reach[sid]]
            best = max(best, *fits) if fits else best
        ids = {sid for sid, r in reach.items() if best and best <= r
               and best in self.snaps[sid].boundaries()}
        return best, ids

    def _pad(self, model: int, toks: tuple[int, ...]) -> tuple[int, ...]:
        bs = IDENTS[model].block_size
        return toks + (0,) * (-len(toks) % bs)

    def _ready_ids(self, model: int | None = None) -> list[int]:
        return sorted(s for s, v in self.snaps.items() if model is None or v.model == model)

    # -- rules --------------------------------------------------------------------

    def _publish(self, model: int, toks: tuple[int, ...], parent: int | None,
                 marks_in: list[int]) -> None:
        ident = IDENTS[model]
        bs = ident.block_size
        start = 0 if parent is None else len(self.snaps[parent].tokens)
        res = self.store.publish(ident, 0, _arr(toks), pages_for(ident, _arr(toks), start=start),
                                 parent=parent, breakpoints=marks_in)
        same = self._by_tokens(model, toks)
        if same is not None:
            assert res.deduplicated and res.snapshot_id == same and res.bytes_written == 0
            return
        assert not res.deduplicated and res.state == "ready" and res.n_tokens == len(toks)
        assert res.snapshot_id not in self.snaps
        compact = parent is not None and self.snaps[parent].depth + 1 >= MAX_CHAIN
        assert res.compacted == compact
        # Compaction reads the parent's chain but is no cache hit: nothing is stamped.
        keep = parent is not None and not compact
        self.snaps[res.snapshot_id] = Snap(
            model=model, tokens=toks, parent=parent if keep else None,
            start=start if keep else 0,
            depth=self.snaps[parent].depth + 1 if keep and parent is not None else 0,
            # Outside (0, n] ignored; below one block nothing (the end stays the end).
            marks=frozenset(b // bs * bs for b in marks_in if bs <= b <= len(toks)),
            last_used=self._next_tick(),
        )

    @rule(model=st.sampled_from(range(len(IDENTS))), body=chunked, data=st.data())
    def publish(self, model: int, body: tuple[int, ...], data: st.DataObject) -> None:
        toks = self._pad(model, body)
        marks = data.draw(_breakpoints(len(toks)), label="breakpoints")
        self._publish(model, toks, None, marks)

    @precondition(lambda self: self.snaps)
    @rule(tail=chunked, data=st.data())
    def extend(self, tail: tuple[int, ...], data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._ready_ids()), label="parent")
        model = self.snaps[parent].model
        toks = self.snaps[parent].tokens + self._pad(model, tail)
        marks = data.draw(_breakpoints(len(toks)), label="breakpoints")
        self._publish(model, toks, parent, marks)

    def _prompt(self, data: st.DataObject) -> tuple[int, tuple[int, ...]]:
        """A prompt: mostly a stored snapshot's tokens, cut or extended, else fresh chunks."""
        kinds = ["cut", "extended", "exact", "fresh"] if self.snaps else ["fresh"]
        kind = data.draw(st.sampled_from(kinds), label="prompt kind")
        if kind == "fresh":
            model = data.draw(st.sampled_from(range(len(IDENTS))), label="model")
            return model, data.draw(chunked, label="prompt")
        s = self.snaps[data.draw(st.sampled_from(self._ready_ids()), label="base")]
        if kind == "exact":
            return s.model, s.tokens
        if kind == "extended":
            return s.model, s.tokens + data.draw(chunked, label="suffix")
        cut = data.draw(st.integers(1, len(s.tokens)), label="cut")
        return s.model, s.tokens[:cut] + data.draw(chunked | st.just(()), label="suffix")

    @initialize(model=st.sampled_from(range(len(IDENTS))),
                bodies=st.lists(chunked, min_size=1, max_size=4))
    def seed_store(self, model: int, bodies: list[tuple[int, ...]]) -> None:
        for body in bodies:
            self._publish(model, self._pad(model, body), None, [])

    @rule(data=st.data())
    def lookup_and_read(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="lookups")):
            self._lookup_and_read(data)

    def _lookup_and_read(self, data: st.DataObject) -> None:
        model, prompt = self._prompt(data)
        ident = IDENTS[model]
        m = self.store.lookup(ident, _arr(prompt))
        want, ids = self._expected(model, prompt)
        if want == 0:
            assert m is None, f"expected a miss, got {m}"
            return
        assert m is not None, f"expected {want} tokens from {sorted(ids)}, got a miss"
        assert m.n_tokens == want and m.snapshot_id in ids, (m.n_tokens, m.snapshot_id, want, ids)
        assert np.array_equal(m.token_ids, _arr(prompt[:want]))
        bs = ident.block_size
        n = data.draw(st.integers(1, want // bs), label="blocks read") * bs
        if data.draw(st.booleans(), label="read_into"):
            out = [np.full((want // bs + 1, ident.page_nbytes), 0xEE, np.uint8)
                   for _ in range(LAYERS)]
            assert self.store.read_into(m, 0, out, n_tokens=n) == n // bs
            got = [o[: n // bs] for o in out]
            assert all((o[n // bs :] == 0xEE).all() for o in out)  # nothing past n
        else:
            got = self.store.read(m, 0, n_tokens=n)
        self._touch(m.snapshot_id, n)
        for g, w in zip(got, pages_for(ident, _arr(prompt[:n])), strict=True):
            assert np.array_equal(g, w)

    @precondition(lambda self: len(self.snaps) >= 3)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self._ready_ids()), label="victim")
        subtree = self._subtree(sid)
        if any(target in subtree for target in self.leases.values()):
            with pytest.raises(LeaseError):
                self.store.delete(sid)
            return
        assert sorted(self.store.delete(sid)) == sorted(subtree)
        for sub in subtree:
            self._forget(sub)

    @precondition(lambda self: len(self.snaps) >= 4)
    @rule(count=st.integers(1, 3))
    def evict(self, count: int) -> None:
        want: list[int] = []
        while len(want) < count:
            leased = set(self.leases.values())
            candidates = sorted(
                (s.last_used, sid) for sid, s in self.snaps.items()
                if sid not in self.pinned and sid not in leased and not self._children(sid)
            )[: count - len(want)]
            if not candidates:
                break
            for _t, sid in candidates:
                self._forget(sid)
                want.append(sid)
        assert self.store.evict(count=count) == want

    @precondition(lambda self: self.snaps)
    @rule(data=st.data(), flag=st.booleans())
    def pin(self, data: st.DataObject, flag: bool) -> None:
        sid = data.draw(st.sampled_from(self._ready_ids()), label="pinned")
        self.store.pin(sid, flag)
        (self.pinned.add if flag else self.pinned.discard)(sid)

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self._ready_ids()), label="leased")
        self.leases[self.store.acquire_lease(sid, ttl=LEASE_TTL)] = sid

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted(self.leases)), label="lease")
        assert self.store.release_lease(lease)
        del self.leases[lease]
        assert not self.store.release_lease(lease)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self._open()
        assert (self.store.alias_stride, self.store.max_chain) == (STRIDE, MAX_CHAIN)
        for sid, s in self.snaps.items():  # every end is still found, no read needed
            m = self.store.lookup(IDENTS[s.model], _arr(s.tokens))
            assert m is not None and m.n_tokens == len(s.tokens), (sid, m)

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def index_agrees_with_model(self) -> None:
        rows = {s.id: s for s in self.store.snapshots()}
        assert set(rows) == set(self.snaps)
        for sid, s in self.snaps.items():
            row = rows[sid]
            assert row.state == "ready" and row.n_tokens == len(s.tokens)
            assert (row.parent_id, row.start_token, row.depth) == (s.parent, s.start, s.depth)
            assert row.depth < MAX_CHAIN
            assert row.pinned == (sid in self.pinned)
            assert row.use_count == s.uses
        # LRU stamps: the store's last_used must order (and tie) exactly like the model's.
        stamps = sorted((s.last_used, rows[sid].last_used) for sid, s in self.snaps.items())
        for (t1, u1), (t2, u2) in itertools.pairwise(stamps):
            assert (t1 < t2) == (u1 < u2) and (t1 == t2) == (u1 == u2), stamps


StoreMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreMachine = StoreMachine.TestCase


def test_breakpoint_below_one_block_keeps_the_end_visible(tmp_path: Path) -> None:
    """A breakpoint inside the first block must not hide the snapshot's own end.

    Regression: ``publish`` rounded breakpoints down to whole blocks, so one in
    (0, block_size) became 0 and ``_insert_boundaries`` filed a row for block
    index -1, i.e. the *last* hash with ``n_tokens=0``.  Boundaries are keyed by
    (prefix_hash, snapshot_id) and inserted with OR IGNORE, so the real "end" row
    was dropped and the snapshot could never be found.
    """
    ident = identity()
    toks = np.arange(1, 9, dtype=np.uint32)  # 2 blocks, no stride alias below 16
    with SnapshotStore(tmp_path / "s", alias_stride=STRIDE) as store:
        store.publish(ident, 0, toks, pages_for(ident, toks), breakpoints=[2, 0, -3, 99])
        m = store.lookup(ident, toks)
        assert m is not None and m.n_tokens == 8
        assert store.lookup(ident, toks[:7]) is None  # no boundary at 4 (nor at 0)
