"""Several processes on one store: publishes (the same prompts at once), extends, reads.

Four spawned processes hammer one store root for a few seconds.  Every exception a
child sees is sent back; the only one allowed is StoreTimeout (the documented busy
timeout).  Every read is compared with the bytes that were published.  Afterwards
the index and the files agree and every snapshot reads back whole.

The prompts move on with the clock (one family of prefixes per time slot), so the
children keep publishing the *same* new prompts at the same moment: publishes
collide on one snapshot key and must deduplicate while the first is in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore, prefix_hashes, prefix_seed
from sparkcache import publish as publish_module
from sparkcache.errors import NotFound, SparkCacheError, StoreTimeout

from .helpers import identity, pages_for, tokens

WORKERS = 4
RUN_S = 6.0
SLOT_S = 0.25  # every child works on family int(elapsed / SLOT_S)
FAMILIES = int(RUN_S / SLOT_S) + 2
LONG = 64
STEP = 8
STRIDE = 16
MAX_CHAIN = 3


def _family(f: int) -> np.ndarray:
    return tokens(LONG, seed=5000 + f)


def _prompts() -> list[np.ndarray]:
    return [_family(f)[:k] for f in range(FAMILIES) for k in range(STEP, LONG + 1, STEP)]


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return len(got) == len(want) and all(
        np.array_equal(g, w) for g, w in zip(got, want, strict=True)
    )


def _worker(root: str, wid: int, barrier: Any, results: Any) -> None:
    ident = identity()
    rng = random.Random(wid)
    counts: Counter[str] = Counter()
    errors: list[str] = []
    try:
        store = SnapshotStore(root)
        barrier.wait(timeout=120)
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < RUN_S:
            slot = min(int(elapsed / SLOT_S), FAMILIES - 1)
            try:
                if rng.random() < 0.6:
                    # Mostly the prefix the slot has reached (all children at once, each
                    # one an extend of the last: chains grow and get compacted), else any.
                    k = 1 + int(elapsed % SLOT_S / SLOT_S * LONG / STEP)
                    if rng.random() < 0.3:
                        k = rng.randint(1, LONG // STEP)
                    _publish_one(store, ident, _family(slot)[: STEP * k], counts)
                else:
                    family = _family(rng.randint(0, slot))
                    prompt = family[: rng.randint(1, LONG)]
                    if rng.random() < 0.3:
                        prompt = np.concatenate([prompt, tokens(7, seed=rng.randint(0, 9))])
                    _read_one(store, ident, prompt, counts, errors)
            except StoreTimeout:
                counts["timeouts"] += 1
            except Exception:
                errors.append(f"worker {wid}:\n{traceback.format_exc()}")
        store.close()
    except Exception:
        errors.append(f"worker {wid} (setup):\n{traceback.format_exc()}")
    results.put((wid, dict(counts), errors))


def _publish_one(store: SnapshotStore, ident: Any, toks: np.ndarray, counts: Counter[str]) -> None:
    parent, start = None, 0
    m = store.lookup(ident, toks)
    if m is not None and m.n_tokens < len(toks):
        info = store.snapshot(m.snapshot_id)
        if info.n_tokens == m.n_tokens:
            parent, start = info.id, info.n_tokens
    res = store.publish(ident, 0, toks, pages_for(ident, toks, start=start), parent=parent)
    counts["publishes"] += 1
    counts["extends"] += parent is not None
    counts["compacted"] += res.compacted
    if res.deduplicated:
        counts["deduplicated"] += 1
        counts["deduplicated_in_flight"] += res.state == "pending"


def _read_one(store: SnapshotStore, ident: Any, prompt: np.ndarray, counts: Counter[str],
              errors: list[str]) -> None:
    m = store.lookup(ident, prompt)
    counts["lookups"] += 1
    if m is None:
        return
    got = store.read(m, 0)
    counts["reads"] += 1
    if not _same(got, pages_for(ident, prompt[: m.n_tokens])):
        errors.append(f"read of {m.n_tokens} tokens from snapshot {m.snapshot_id}: WRONG BYTES")


@pytest.mark.slow
def test_processes_publish_and_read_concurrently(tmp_path: Path) -> None:
    root = tmp_path / "store"
    SnapshotStore(root, alias_stride=STRIDE, max_chain=MAX_CHAIN).close()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORKERS + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(root), w, barrier, results))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=120)
        outcomes = [results.get(timeout=RUN_S + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)
    totals: Counter[str] = Counter()
    problems: list[str] = []
    for _wid, counts, errors in outcomes:
        totals.update(counts)
        problems.extend(errors)
    assert not problems, "\n".join(problems)
    print(dict(totals))
    assert totals["publishes"] > 100 and totals["reads"] > 50 and totals["extends"] > 0
    assert totals["deduplicated"] > 0 and totals["compacted"] > 0

    bs = identity().block_size
    keys = {prefix_hashes(prefix_seed(identity()), t, bs)[-1].hex(): t for t in _prompts()}
    with SnapshotStore(root) as store:
        report = store.check()
        assert report.clean, report
        infos = store.snapshots()
        assert infos and all(info.state == "ready" for info in infos)
        for info in infos:
            toks = keys[info.snap_key]
            m = store.lookup(identity(), toks)
            assert m is not None and m.n_tokens == len(toks) == info.n_tokens
            assert _same(store.read(m, 0), pages_for(identity(), toks))


def test_extend_while_the_parent_is_deleted_is_a_clean_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``publish(parent=p)`` checks p in a read transaction, then inserts the child in
    a write transaction.  When another process deletes (or evicts) p in between, the
    child's INSERT hits the foreign key and ``apsw.ConstraintError`` escapes: not a
    SparkCacheError, so a caller that treats sparkcache errors as a miss crashes.
    It must raise NotFound ("parent is not restorable; publish without parent").

    The window is made wide, not mocked: a second connection holds the write lock
    while the publish reads its parent, then deletes the parent and commits.  An
    event set once the publish has checked its parent (before its write
    transaction) says when to delete.
    """
    planned = threading.Event()
    reserve = publish_module._reserve

    def reserve_after_the_check(*args: Any) -> Any:
        planned.set()  # the parent was read; the write lock comes next
        return reserve(*args)

    monkeypatch.setattr(publish_module, "_reserve", reserve_after_the_check)
    ident = identity()
    root = tmp_path / "store"
    head = tokens(8)
    full = np.concatenate([head, tokens(8, seed=1)])
    with SnapshotStore(root, alias_stride=STRIDE) as store, SnapshotStore(root) as other:
        parent = store.publish(ident, 0, head, pages_for(ident, head)).snapshot_id
        outcome: list[BaseException | object] = []

        def extend() -> None:
            try:
                outcome.append(store.publish(ident, 0, full, pages_for(ident, full, start=8),
                                             parent=parent))
            except BaseException as exc:
                outcome.append(exc)

        with other._core.write():  # hold the index write lock
            worker = threading.Thread(target=extend)
            worker.start()
            assert planned.wait(30), "the publish never checked its parent"
            assert other.delete(parent) == [parent]
        worker.join(timeout=30)
        (result,) = outcome
        assert isinstance(result, SparkCacheError), f"{type(result).__name__}: {result}"
        assert isinstance(result, NotFound), result
        assert store.snapshots() == [] and store.lookup(ident, full) is None
        assert store.check().clean
        assert list(store.backend.list("objects")) == []
