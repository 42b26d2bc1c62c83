"""Several KV cache groups (vLLM's hybrid allocator): a sliding-window group
and a full-attention group, each with its own block table.

The scheduler side gets one block-id list per group (the sliding group's
holds vLLM's null block, id 0, below its window); saves take the full group's
blocks and the sliding group's window, loads put each back in its own group's
blocks; only snapshot ends are offered (the window is stored there); a
breakpoint's save copies the window before the step ends (vLLM frees it on the
next one); a failed load is reported as a failed request (vLLM's
``failed_recving``), never as block ids, which are ambiguous across groups.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache import segment as seg
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters
from sparkcache.connector.kvlayers import LayerGroups
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO
from sparkcache.identity import WINDOW_BLOCKS_KEY

from .helpers import BS, PAGE_NBYTES, Req, finished, identity, prompt, step

KEEP = 2  # the sliding group's window, in blocks (layer 0); layer 1: full attention
NULL = 0


class OneLayer:
    """One group's KV cache: a single layer of numpy pages."""

    def __init__(self, blocks: int, seed: int) -> None:
        self.arr = np.random.default_rng(seed).integers(0, 255, (blocks, PAGE_NBYTES), np.uint8)
        self.num_blocks, self.page_nbytes = blocks, PAGE_NBYTES

    def __len__(self) -> int:
        return 1

    def block_views(self, block_ids: Any) -> list[list[np.ndarray]] | None:
        return [[self.arr[b] for b in block_ids]] if block_ids else None

    def fence(self) -> object:
        return None

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        return [self.arr[list(block_ids)].copy()]

    def scatter(self, block_ids: Any, pages: Any) -> None:
        self.scatter_layer(0, block_ids, pages[0])

    def scatter_layer(self, layer: int, block_ids: Any, src: Any) -> None:
        self.arr[list(block_ids)] = np.asarray(src).reshape(-1, PAGE_NBYTES)


Setup = tuple[SnapshotStore, SchedulerSide, WorkerIO, list[OneLayer], Counters]


@pytest.fixture
def grouped(tmp_path: Path) -> Iterator[Setup]:
    ident = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP},0"),))
    store = SnapshotStore(tmp_path / "s")
    counters = Counters()
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, load_async=False,
                          groups=KVGroups((KEEP, 0)))
    pages = [OneLayer(64, seed=1), OneLayer(64, seed=2)]  # group 0 sliding, group 1 full
    io = WorkerIO(store, ident, 0, pages[0], counters,
                  groups=LayerGroups(pages, [(0, 0), (1, 0)]))
    yield store, sched, io, pages, counters
    io.close()
    store.close()


def _sliding(n_blocks: int, held: list[int]) -> list[int]:
    """A sliding group's block list: null below the blocks it still holds."""
    return [NULL] * (n_blocks - len(held)) + held


def _publish(setup: Setup) -> tuple[Req, list[list[int]]]:
    _store, sched, io, _pages, _counters = setup
    req = finished(Req("a", prompt(100, 1)))  # 116 tokens, 115 computed: 7 whole blocks
    blocks = [_sliding(8, [20, 21, 22]), list(range(1, 9))]
    held, _ = sched.finished(req, tuple(blocks))
    assert held
    _, (job,) = sched.take_jobs()
    assert job.parent is None and job.start_block == 0
    assert job.blocks == ((20, 21), tuple(range(1, 8)))  # from blocks 5 and 0
    io.submit_save(job)
    assert io.flush()
    sent, _ = io.poll()
    assert sent == {"a"}
    sched.on_output((), sent)
    return req, blocks


def test_a_save_keeps_each_groups_blocks_and_only_the_window(grouped: Setup) -> None:
    store, *_ = grouped
    _publish(grouped)
    (snap,) = [s for s in store.snapshots() if s.state == "ready"]
    assert snap.n_tokens == 112 and snap.parent_id is None
    # 7 full-attention blocks and the 2 window blocks, plus token ids and the
    # header (padded to whole pages: the data starts page-aligned).
    header = snap.nbytes - (7 + KEEP) * PAGE_NBYTES - 112 * 4
    assert header > 0 and header % seg.DATA_ALIGN == 0


def test_a_restore_lands_in_each_groups_own_blocks(grouped: Setup) -> None:
    _store, sched, io, pages, counters = grouped
    req, _ = _publish(grouped)
    sliding_src, full_src = pages[0].arr[[20, 21]].copy(), pages[1].arr[1:8].copy()
    nxt = Req("b", req.all_token_ids + prompt(30, 2))
    # Always asynchronous with several groups (only those report a failed request).
    assert sched.matched_tokens(nxt, 0) == (112, True)
    sched.after_alloc(nxt, (_sliding(10, [40, 41, 42, 43, 44]), list(range(50, 60))), 112)
    (job,), _ = sched.take_jobs()
    assert not job.in_step
    assert job.blocks == ((40, 41), tuple(range(50, 57)))  # from blocks 5 and 0
    io.submit_load(job)
    assert io.flush()
    assert io.poll() == (set(), {"b"})
    assert io.take_failed_requests() == set() and io.take_failed_blocks() == set()
    assert np.array_equal(pages[0].arr[[40, 41]], sliding_src)
    assert np.array_equal(pages[1].arr[50:57], full_src)
    assert counters.take()["loaded_bytes"] == (7 + KEEP) * PAGE_NBYTES


def test_only_whole_snapshots_are_offered(grouped: Setup) -> None:
    """The same prompt again: the index's best match is the alias at the prompt's
    end, inside the snapshot, whose window was not stored: not offered."""
    store, sched, *_ = grouped
    req, _ = _publish(grouped)
    again = Req("c", list(req.prompt_token_ids))
    match = store.lookup(sched.identity, np.asarray(again.prompt_token_ids[:96], np.uint32))
    assert match is not None and match.n_tokens == 96  # the store has it ...
    assert sched.matched_tokens(again, 0) == (0, False)  # ... its window it has not


def test_a_failed_restore_is_a_failed_request_not_failed_blocks(grouped: Setup) -> None:
    store, sched, io, _pages, counters = grouped
    req, _ = _publish(grouped)
    nxt = Req("d", req.all_token_ids + prompt(30, 3))
    assert sched.matched_tokens(nxt, 0) == (112, True)
    for path in store.root.rglob("*.safetensors"):  # flip a payload byte
        data = bytearray(path.read_bytes())
        data[-(112 * 4) - 10] ^= 0xFF
        path.write_bytes(bytes(data))
    sched.after_alloc(nxt, (_sliding(10, [40, 41, 42, 43, 44]), list(range(50, 60))), 112)
    (job,), _ = sched.take_jobs()
    io.submit_load(job)
    assert io.flush()
    assert io.poll() == (set(), {"d"})
    assert io.take_failed_requests() == {"d"}
    assert io.take_failed_blocks() == set()
    assert counters.take().get("load_failures") == 1


class LateCopies(OneLayer):
    """A group whose copies off the calling thread wait for ``go``: the saver
    thread copies it only after the test let vLLM reuse its blocks."""

    def __init__(self, blocks: int, seed: int) -> None:
        super().__init__(blocks, seed)
        self.go = threading.Event()
        self.caller = threading.current_thread()

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        if threading.current_thread() is not self.caller:
            assert self.go.wait(10)
        return super().gather(block_ids, after)


def _breakpoint_save(setup: Setup) -> tuple[Req, dict[int, np.ndarray]]:
    """Request "a" (100 tokens, a breakpoint at 70) prefilled in two steps of 80
    and 20; the first plans the save of 64 tokens, its worker copies the
    window in the step, then vLLM frees the window's blocks and a next
    forward writes them.  Returns the request and the pages saved, by block."""
    _store, sched, io, pages, counters = setup
    req = Req("a", prompt(100, 1), kv_transfer_params={"sparkcache": {"breakpoints": [70]}})
    assert sched.matched_tokens(req, 0) == (0, False)  # (notes its breakpoints)
    blocks = [_sliding(5, [12, 13, 14]), [1, 2, 3, 4, 5]]
    (job,) = step(sched, req, 80, blocks)  # type: ignore[arg-type]
    assert job.token_ids.size == 64 and not job.report and job.parent is None
    assert job.blocks == ((12, 13), (1, 2, 3, 4))  # from blocks 2 and 0
    assert job.copy_in_step == (0,)  # the sliding group: its blocks go with the step
    saved = {b: pages[0].arr[b].copy() for b in (12, 13)}
    io.submit_save(job)  # vLLM's wait_for_save, at the end of the step
    pages[0].arr[[12, 13]] = 7  # the next step: freed, reused, overwritten
    late = pages[0]
    if isinstance(late, LateCopies):
        late.go.set()
    assert io.flush()
    assert counters.take().get("saves") == 1
    return req, saved


def test_a_breakpoint_save_copies_the_window_before_the_step_ends(tmp_path: Path) -> None:
    """The window's blocks are copied in ``submit_save`` (the step's
    ``wait_for_save``), not by the saver thread after vLLM gave them away: a
    restore of the breakpoint's prefix puts back what the step computed."""
    ident = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP},0"),))
    store = SnapshotStore(tmp_path / "s")
    counters = Counters()
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, groups=KVGroups((KEEP, 0)))
    pages = [LateCopies(64, seed=1), OneLayer(64, seed=2)]
    io = WorkerIO(store, ident, 0, pages[0], counters,
                  groups=LayerGroups(pages, [(0, 0), (1, 0)]))
    try:
        req, saved = _breakpoint_save((store, sched, io, pages, counters))
        (snap,) = [s for s in store.snapshots() if s.state == "ready"]
        assert snap.n_tokens == 64
        nxt = Req("b", req.prompt_token_ids[:70] + prompt(40, 5))
        assert sched.matched_tokens(nxt, 0) == (64, True)
        sched.after_alloc(nxt, (_sliding(6, [40, 41, 42, 43]), list(range(50, 56))), 64)
        (load,), _ = sched.take_jobs()
        assert load.blocks == ((40, 41), (50, 51, 52, 53))  # from blocks 2 and 0
        io.submit_load(load)
        assert io.flush() and io.take_failed_requests() == set()
        assert np.array_equal(pages[0].arr[40], saved[12])
        assert np.array_equal(pages[0].arr[41], saved[13])
    finally:
        io.close()
        store.close()


def test_breakpoints_reached_in_one_step_are_saved_one_snapshot_each(
    grouped: Setup,
) -> None:
    """A window is stored at a snapshot's end only, so two breakpoints reached
    in one step (e.g. a whole prompt prefilled at once) are two snapshots -
    where one model without windows makes one snapshot and an alias - and so
    is the prompt's last whole block, where the same prompt sent again
    restores (no breakpoint: nothing of it is reported written)."""
    store, sched, io, _pages, _counters = grouped
    marks = {"sparkcache": {"breakpoints": [40, {"at": 70, "ttl": 60}]}}
    req = Req("f", prompt(100, 7), kv_transfer_params=marks)
    assert sched.matched_tokens(req, 0) == (0, False)
    jobs = step(sched, req, 100, [_sliding(7, [10, 11, 12, 13, 14, 15, 16]),  # type: ignore[arg-type]
                                  list(range(1, 8))])
    assert [j.token_ids.size for j in jobs] == [32, 64, 96]
    assert [j.blocks[0] for j in jobs] == [(10, 11), (12, 13), (14, 15)]  # from 0, 2, 4
    assert [j.breakpoints for j in jobs] == [(40,), (40, 70), (40, 70)]
    assert [j.keep for j in jobs] == [None, 60.0, None]
    assert all(j.copy_in_step == (0,) for j in jobs)
    for job in jobs:
        io.submit_save(job)
    assert io.flush()
    assert sorted(s.n_tokens for s in store.snapshots() if s.state == "ready") == [32, 64, 96]
    other = Req("g", req.prompt_token_ids[:50] + prompt(40, 8))
    assert sched.matched_tokens(other, 0) == (32, True)
    again = Req("h", list(req.prompt_token_ids))  # the same prompt: 96 of its 99
    assert sched.matched_tokens(again, 0) == (96, True)
    req.num_computed_tokens = 100
    _held, params = sched.finished(req, [_sliding(7, [10, 11, 12, 13, 14, 15, 16]),
                                         list(range(1, 8))])
    assert params is not None and params["sparkcache"]["written_tokens"] == 64


def test_a_windowed_lookup_offers_the_longest_snapshot_end(grouped: Setup) -> None:
    """A finished request is stored whole (112 tokens, aliases at its
    breakpoint and prompt end); a prompt sharing its first 100 tokens only
    matches those aliases, where no window is stored: the offer is the
    breakpoint's own snapshot, which ends at 64."""
    store, sched, io, _pages, _counters = grouped
    req, _saved = _breakpoint_save(grouped)
    req.num_computed_tokens = 80
    held, _ = sched.finished(finished(req), (_sliding(8, [20, 21, 22]), list(range(1, 9))))
    assert held
    _, (job,) = sched.take_jobs()
    assert job.parent is None and job.copy_in_step == ()  # (vLLM holds a finished one's)
    io.submit_save(job)
    assert io.flush()
    ends = sorted(s.n_tokens for s in store.snapshots() if s.state == "ready")
    assert ends == [64, 112]
    nxt = Req("c", req.prompt_token_ids + prompt(30, 6))
    match = store.lookup(sched.identity, np.asarray(nxt.prompt_token_ids[:128], np.uint32))
    assert match is not None and match.n_tokens == 96  # the longest alias, in the 112
    assert sched.matched_tokens(nxt, 0) == (64, True)


def test_no_save_when_vllm_freed_part_of_the_window(grouped: Setup) -> None:
    _store, sched, _io, _pages, counters = grouped
    req = finished(Req("e", prompt(100, 4)))
    held, _ = sched.finished(req, (_sliding(8, [22]), list(range(1, 9))))
    assert not held and sched.take_jobs() == ([], [])
    assert counters.take().get("saves_windowless") == 1


@pytest.mark.parametrize("use_numpy", [True, False])
def test_real_kv_pages_of_two_groups_round_trip(tmp_path: Path, use_numpy: bool) -> None:
    """The same save and restore over :class:`~sparkcache.cuda.KVPages` of CPU
    tensors: straight into the cache's memory (numpy views), and through host
    buffers scattered layer by layer (the torch path a GPU cache takes)."""
    torch = pytest.importorskip("torch")
    from sparkcache.cuda import KVPages

    ident = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP},0"),))
    gen = torch.Generator().manual_seed(5)

    def cache() -> Any:  # [blocks, *page_shape] float32, as identity() says
        return torch.randn((64, *ident.page_shape), generator=gen)

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    src = {names[0]: cache(), names[1]: cache()}
    dst = {names[0]: cache(), names[1]: cache()}
    before = {name: t.clone() for name, t in dst.items()}

    def worker(kv: dict[str, Any]) -> WorkerIO:
        pages = [KVPages({names[0]: kv[names[0]]}, use_numpy=use_numpy),
                 KVPages({names[1]: kv[names[1]]}, use_numpy=use_numpy)]
        return WorkerIO(store, ident, 0, pages[0], counters,
                        groups=LayerGroups(pages, [(0, 0), (1, 0)]))

    store, counters = SnapshotStore(tmp_path / "s"), Counters()
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, groups=KVGroups((KEEP, 0)))
    saver, loader = worker(src), worker(dst)
    try:
        req = finished(Req("a", prompt(100, 1)))
        assert sched.finished(req, (_sliding(8, [20, 21, 22]), list(range(1, 9))))[0]
        _, (save_job,) = sched.take_jobs()
        saver.submit_save(save_job)
        assert saver.flush()
        nxt = Req("b", req.all_token_ids + prompt(30, 2))
        assert sched.matched_tokens(nxt, 0) == (112, True)
        sched.after_alloc(nxt, (_sliding(10, [40, 41, 42, 43, 44]), list(range(50, 60))), 112)
        (load_job,), _ = sched.take_jobs()
        loader.submit_load(load_job)
        assert loader.flush()
        assert loader.take_failed_requests() == set()
        assert torch.equal(dst[names[0]][[40, 41]], src[names[0]][[20, 21]])
        assert torch.equal(dst[names[1]][50:57], src[names[1]][1:8])
        for name, written in ((names[0], [40, 41]), (names[1], list(range(50, 57)))):
            others = [b for b in range(64) if b not in written]
            assert torch.equal(dst[name][others], before[name][others])  # nothing else
        assert counters.take()["loaded_bytes"] == (7 + KEEP) * ident.page_nbytes
    finally:
        saver.close()
        loader.close()
        store.close()
