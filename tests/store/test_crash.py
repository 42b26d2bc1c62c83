"""SIGKILL at any moment never leaves wrong data, a visible half-publish or a stuck store.

A child process publishes, extends and evicts in a loop on one store root; the parent kills
it with SIGKILL at random moments, both inside ``publish`` and between publishes,
then reopens the store and checks what every prompt the child may have published
restores.  The root is shared by all trials, so damage accumulates.  At the end
``check(fix=True)`` must remove everything the crashes left behind.

Children come from a forkserver that has already imported sparkcache and numpy:
a fresh interpreter per trial would spend ~0.8 s on imports alone.  Each child is
still its own process with its own index connection, forked from a server that
never opened a store.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore, prefix_hashes, prefix_seed
from sparkcache.errors import InvalidArgument

from .helpers import identity, pages_for, tokens

pytestmark = pytest.mark.slow

TRIALS = 60
STRIDE = 16
MAX_CHAIN = 3
FAMILIES = 4
STEP = 8  # prompts are the prefixes L[:8], L[:16], ... of a few long sequences
LONG = 64
KILL_AFTER_S = (0.0, 0.150)
# Child flags (shared memory, no lock: a lock held at SIGKILL would hang the parent).
READY, IN_PUBLISH, PUBLISHED = range(3)
EVICTING = 2  # IN_PUBLISH holds 1 inside publish, this inside evict


def _prompts() -> list[np.ndarray]:
    return [tokens(LONG, seed=1000 + f)[:k] for f in range(FAMILIES)
            for k in range(STEP, LONG + 1, STEP)]


def _publisher(root: str, seed: int, flags: Any, errors: str) -> None:
    """Child: publish (fresh or as an extend of the longest stored prefix) and evict, forever."""
    ident = identity()
    rng = random.Random(seed)
    prompts = _prompts()

    def report(what: str) -> None:
        fd = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"--- child {seed}: {what}\n".encode())
        finally:
            os.close(fd)

    store = SnapshotStore(root)
    flags[READY] = 1
    while True:
        toks = rng.choice(prompts)
        parent, start = None, 0
        try:
            m = store.lookup(ident, toks)
            if m is not None and m.n_tokens < len(toks):
                info = store.snapshot(m.snapshot_id)
                if info.n_tokens == m.n_tokens:
                    parent, start = info.id, info.n_tokens
                elif rng.random() < 0.3:  # a read as well, so kills land in reads too
                    got = store.read(m, 0)
                    want = pages_for(ident, toks[: m.n_tokens])
                    if not all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)):
                        report(f"read of {m} returned wrong bytes")
        except Exception:
            report(traceback.format_exc())
        pages = pages_for(ident, toks, start=start)
        flags[IN_PUBLISH] = 1
        try:
            store.publish(ident, 0, toks, pages, parent=parent, breakpoints=[len(toks) // 2])
        except Exception:
            report(f"publish of {len(toks)} tokens (parent {parent}):\n{traceback.format_exc()}")
        flags[IN_PUBLISH] = 0
        flags[PUBLISHED] += 1
        if rng.random() < 0.3:  # make room, so that publishes keep writing files
            flags[IN_PUBLISH] = EVICTING
            try:
                store.evict(count=rng.randint(1, 3))
            except Exception:
                report(f"evict:\n{traceback.format_exc()}")
            flags[IN_PUBLISH] = 0
        time.sleep(rng.uniform(0, 0.004))


@pytest.fixture(scope="module")
def forkserver() -> Iterator[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "sparkcache", "numpy"])
    yield ctx


def _keys() -> dict[str, np.ndarray]:
    seed = prefix_seed(identity())
    return {prefix_hashes(seed, t, identity().block_size)[-1].hex(): t for t in _prompts()}


def _verify(store: SnapshotStore, keys: dict[str, np.ndarray], *, longer: bool = False) -> int:
    """Every prompt restores None or exactly the right bytes; nothing pending is offered.

    ``longer`` also looks up every prompt followed by other tokens.  Returns the hits.
    """
    ident = identity()
    hits = 0
    extra = tokens(5, seed=7)
    for toks in _prompts():
        for prompt in (toks, np.concatenate([toks, extra]))[: 2 if longer else 1]:
            m = store.lookup(ident, prompt)
            if m is None:
                continue
            hits += 1
            assert store.snapshot(m.snapshot_id).state == "ready"
            got = store.read(m, 0)  # never CorruptSnapshot, never NotFound
            want = pages_for(ident, prompt[: m.n_tokens])
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), m
    for info in store.snapshots():
        assert info.state in ("pending", "ready"), info  # nothing failed verification
        if info.state == "pending":
            m = store.lookup(ident, keys[info.snap_key])
            assert m is None or m.snapshot_id != info.id, f"pending {info} offered"
    return hits


def _files(root: Path) -> set[str]:
    objects = root / "objects"
    return {
        str(Path(folder, name).relative_to(root))
        for folder, _dirs, names in os.walk(objects) for name in names
    }


def _referenced(store: SnapshotStore) -> set[str]:
    with store.db.read() as conn:
        return {key for (key,) in conn.execute("SELECT object_key FROM segments")}


def test_sigkill_never_corrupts(tmp_path: Path, forkserver: Any) -> None:
    root = tmp_path / "store"
    SnapshotStore(root, alias_stride=STRIDE, max_chain=MAX_CHAIN).close()
    errors = tmp_path / "child-errors.txt"
    keys = _keys()
    rng = random.Random(20240607)
    inside = between = unclean = 0
    for trial in range(TRIALS):
        flags = forkserver.RawArray("i", 3)
        child = forkserver.Process(target=_publisher, args=(str(root), trial, flags, str(errors)))
        child.start()
        deadline = time.monotonic() + 30
        while not flags[READY]:
            assert child.is_alive() and time.monotonic() < deadline, "child never got ready"
            time.sleep(0.001)
        time.sleep(rng.uniform(*KILL_AFTER_S))
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join()  # reaped: no zombie holding leases "alive"
        assert child.exitcode == -signal.SIGKILL
        if flags[IN_PUBLISH] == 1:
            inside += 1
        else:
            between += 1

        with SnapshotStore(root) as store:
            _verify(store, keys)
            unclean += not store.check().clean

    assert inside >= 5 and between >= 5, (inside, between)
    assert unclean > 0, "no kill left anything for check() to find: the kills missed"

    with SnapshotStore(root) as store:
        hits = _verify(store, keys, longer=True)
        assert hits > 0
        before = store.check()
        fixed = store.check(fix=True)
        assert fixed.fixed
        after = store.check()
        assert after.clean, after
        assert not [s for s in store.snapshots() if s.state != "ready"]
        # The objects folder holds exactly the files the index references.
        assert _files(root) == _referenced(store)
        # Everything left reads back whole, by its own tokens.
        for info in store.snapshots():
            toks = keys[info.snap_key]
            m = store.lookup(identity(), toks)
            assert m is not None and m.n_tokens == len(toks)
            got = store.read(m, 0)
            assert all(np.array_equal(g, w)
                       for g, w in zip(got, pages_for(identity(), toks), strict=True))
        assert _verify(store, keys, longer=True) == hits
    print(f"kills inside publish: {inside}, between: {between}; check before fix: {before}")
    # Last, so every crash-consistency check above has run: publishing after a crash
    # must work (see test_republish_after_crash_with_another_parent).
    problems = errors.read_text() if errors.exists() else ""
    assert not problems, problems


_CRASH_IN_PUT = """
import os, signal, sys
import numpy as np
from sparkcache import SnapshotStore
sys.path.insert(0, {tests!r})
from store.helpers import identity, pages_for, tokens
ident = identity()
store = SnapshotStore({root!r})
toks = tokens(16)
store.backend.put = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # die mid-publish
store.publish(ident, 0, toks, pages_for(ident, toks))
"""


@pytest.mark.parametrize("first_with_parent", [False, True])
def test_republish_after_crash_with_another_parent(tmp_path: Path,
                                                   first_with_parent: bool) -> None:
    """A publisher SIGKILLed mid-publish leaves a pending snapshot with no live
    publisher.  Publishing the same tokens again, fresh or as an extend, must take
    it over whatever parent the dead publisher had chosen; it must not say that
    "another rank" started it (world_size is 1) and refuse until check(fix=True)."""
    ident = identity()
    root = tmp_path / "store"
    toks = tokens(16)
    with SnapshotStore(root, alias_stride=STRIDE) as store:
        head = store.publish(ident, 0, toks[:8], pages_for(ident, toks[:8])).snapshot_id
    script = _CRASH_IN_PUT.format(tests=str(Path(__file__).parents[1]), root=str(root))
    if first_with_parent:
        script = script.replace("pages_for(ident, toks))",
                                f"pages_for(ident, toks, start=8), parent={head})")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    with SnapshotStore(root) as store:
        (pending,) = [s for s in store.snapshots() if s.state == "pending"]
        assert pending.n_tokens == 16
        assert store.lookup(ident, toks).n_tokens == 8  # type: ignore[union-attr]
        try:
            if first_with_parent:  # now fresh
                res = store.publish(ident, 0, toks, pages_for(ident, toks))
            else:  # now as an extend
                res = store.publish(ident, 0, toks, pages_for(ident, toks, start=8), parent=head)
        except InvalidArgument as exc:
            pytest.fail(f"re-publish after a crash refused: {exc}")
        assert res.state == "ready"
        m = store.lookup(ident, toks)
        assert m is not None and m.n_tokens == 16
        got = store.read(m, 0)
        assert all(np.array_equal(g, w) for g, w in zip(got, pages_for(ident, toks), strict=True))
        store.check(fix=True)
        assert store.check().clean
        assert _files(root) == _referenced(store)
