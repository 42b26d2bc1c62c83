"""The connector's test hooks (:data:`FAULT_ENV`): faults the vLLM tests inject
into real engines to prove that the checks they make can fail.  Never set in
production; nothing here runs unless the variable is set."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

__all__ = ["DIE_AT_PUBLISH", "FAULT_ENV", "HOLD_PUBLISHES_S", "die_at_publish",
           "holds_publishes", "scramble", "slow_restore", "slow_save_step"]

#: ``flip-restored`` scrambles restored pages *after* verification (every layer
#: gets another layer's pages): a wrong restore must change the tokens or
#: logprobs the tests compare.  ``die-publish:<rank>:<file>``: while ``<file>``
#: exists, that rank's worker, at the start of a publish, waits for
#: ``<file>.go`` (the test creates it once the other ranks' segments are
#: written) and is killed: a rank that dies mid-publish.  ``slow-restore``:
#: each restore waits half a second before it reads, so the forward an
#: in-step restore feeds reaches its layers first.  ``hold-publishes``: a save's
#: publish waits as if every step computed prompt tokens, for
#: :data:`HOLD_PUBLISHES_S` at most, unless a request waits for it (a busy
#: engine, where a finished request's save lands late).  ``slow-save-step``: a
#: worker sleeps two seconds in a step that carries saves before it takes them
#: (a stop signal sent right after an answer reaches the worker before its save).
FAULT_ENV = "SPARKCACHE_TEST_FAULT"

#: How long the ``hold-publishes`` fault holds a publish at most.
HOLD_PUBLISHES_S = 30.0

#: The prefix of the ``die-publish`` fault.
DIE_AT_PUBLISH = "die-publish:"


def scramble(layers: list[np.ndarray]) -> list[np.ndarray]:
    """The ``flip-restored`` fault: each layer gets the next layer's pages (one
    layer: zeros).  Not a permutation of blocks: attention sums over (K, V)
    pairs, so moving whole blocks around would leave every answer unchanged."""
    if len(layers) == 1:
        return [np.zeros_like(layers[0])]
    return [layers[i - 1].copy() for i in range(len(layers))]


def die_at_publish(fault: str, rank: int, wait: float = 60.0) -> None:
    """The ``die-publish`` fault: when it names ``rank`` and its trigger file
    exists, wait for ``<trigger>.go`` (at most ``wait`` s) and kill this
    process (SIGKILL: no clean-up at all)."""
    if not fault.startswith(DIE_AT_PUBLISH):
        return
    target, _, trigger = fault.removeprefix(DIE_AT_PUBLISH).partition(":")
    if target != str(rank) or not trigger or not os.path.exists(trigger):
        return
    deadline = time.monotonic() + wait
    while not os.path.exists(trigger + ".go") and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def holds_publishes(fault: str) -> bool:
    """Whether the ``hold-publishes`` fault is set."""
    return fault == "hold-publishes"


def slow_restore(fault: str, seconds: float = 0.5) -> None:
    """The ``slow-restore`` fault: wait ``seconds`` before a restore's read."""
    if fault == "slow-restore":
        time.sleep(seconds)


def slow_save_step(fault: str, saves: int, seconds: float = 2.0) -> None:
    """The ``slow-save-step`` fault: wait ``seconds`` in a step carrying ``saves``."""
    if fault == "slow-save-step" and saves:
        time.sleep(seconds)
