"""Simulated vLLM for the connector's scheduler and worker sides: duck-typed
requests, KV caches of numpy pages, and the steps vLLM would take.

The scheduler side (:class:`SchedulerSide`) and the worker side
(:class:`WorkerIO`) run here exactly as in vLLM's processes, over a real
store; only the requests and the KV cache are stand-ins.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparkcache import ModelIdentity, SnapshotInfo, SnapshotStore
from sparkcache.connector.jobs import SaveJob
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO

BS = 16
LAYERS = 2
PAGE_SHAPE = (1, BS, 8)  # one KV head per rank, K and V of head size 4
PAGE_NBYTES = 1 * BS * 8 * 4


def identity(tp_size: int = 1) -> ModelIdentity:
    return ModelIdentity(model="sim", revision="r1", num_layers=LAYERS, num_kv_heads=1,
                         head_size=4, dtype="float32", kv_cache_dtype="float32",
                         block_size=BS, page_shape=PAGE_SHAPE, tp_size=tp_size)


class FakePages:
    """A worker's KV cache: ``[layers, blocks, page bytes]`` of random bytes."""

    def __init__(self, blocks: int, seed: int, page_nbytes: int = PAGE_NBYTES) -> None:
        rng = np.random.default_rng(seed)
        self.arr = rng.integers(0, 255, (LAYERS, blocks, page_nbytes), dtype=np.uint8)
        self.num_blocks, self.page_nbytes = blocks, page_nbytes

    def __len__(self) -> int:
        return LAYERS

    def block_views(self, block_ids: Any) -> list[list[np.ndarray]] | None:
        # One piece per block (views of the rows), whatever the ids' order.
        return [[self.arr[i, b] for b in block_ids] for i in range(LAYERS)] if block_ids else None

    def fence(self) -> object:
        return None

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        return [self.arr[i, list(block_ids)].copy() for i in range(LAYERS)]

    def scatter(self, block_ids: Any, pages: Any) -> None:
        for i in range(LAYERS):
            self.scatter_layer(i, block_ids, pages[i])

    def scatter_layer(self, layer: int, block_ids: Any, src: Any) -> None:
        self.arr[layer, list(block_ids)] = np.asarray(src).reshape(-1, self.page_nbytes)


class GatedPages(FakePages):
    """FakePages whose copy-outs wait for ``gate`` and are recorded in ``gathered``."""

    def __init__(self, blocks: int, seed: int) -> None:
        super().__init__(blocks, seed)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gathered: list[list[int]] = []

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        self.entered.set()
        assert self.gate.wait(10)
        self.gathered.append(list(block_ids))
        return super().gather(block_ids, after)


@dataclass
class Req:
    """The fields of vLLM's ``Request`` that the scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30000, n)]


def finished(req: Req, n_out: int = 16) -> Req:
    """The request after generating ``n_out`` tokens (the last one's KV not computed)."""
    req.output = prompt(n_out, 999)
    req.num_computed_tokens = len(req.all_token_ids) - 1
    return req


def blocks_of(req: Req) -> list[int]:
    return list(range(len(req.all_token_ids) // BS + 1))


def save(sched: SchedulerSide, io: WorkerIO, req: Req) -> SaveJob:
    """Finish ``req``, run its save on ``io`` and report it back (copied, and
    its publish ended: the worker's metadata), as vLLM would."""
    held, _ = sched.finished(finished(req), blocks_of(req))
    assert held
    _, (job,) = sched.take_jobs()
    io.submit_save(job)
    assert io.flush()
    sent, _ = io.poll()
    assert req.request_id in sent
    assert io.poll() == (set(), set())  # reported exactly once (vLLM asserts otherwise)
    sched.on_output((), sent, None, io.take_ended())
    return job


def step(sched: SchedulerSide, req: Req, n: int, blocks: list[int]) -> list[SaveJob]:
    """One vLLM step computing ``n`` more tokens of ``req``: the saves it plans."""
    sched.plan_breakpoints({req.request_id: n}, lambda _rid: blocks)
    req.num_computed_tokens += n
    return sched.take_jobs()[1]


def published_pages(store: SnapshotStore, p: list[int]) -> tuple[SnapshotInfo, list[np.ndarray]]:
    """Publish 96 tokens of ``p`` (six blocks) with random pages: the snapshot and its pages."""
    pages = [np.random.default_rng(30 + i).integers(0, 256, 6 * PAGE_NBYTES, np.uint8)
             for i in range(LAYERS)]
    store.publish(identity(), 0, p[:96], pages)
    (snap,) = store.snapshots()
    return snap, pages


def ask(sched: SchedulerSide, req: Req, timeout: float = 30.0) -> tuple[int | None, bool]:
    """vLLM's loop: ask again (an idle step waits for the fetch) until answered."""
    deadline = time.monotonic() + timeout
    while True:
        answer = sched.matched_tokens(req, 0)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer
        sched.wait_fetches(0.02)
