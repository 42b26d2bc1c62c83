"""A worker in a process of its own outlives the first stop signal, so that the
engine's last steps still reach it (:func:`outlive_first_signal`).

A Ctrl-C in a terminal, or systemd's stop (``KillMode=control-group``),
signals every process of a server at once.  vLLM's engine core then drains:
it keeps stepping until its requests are done (``--shutdown-timeout``) and
the saves of the last answers are carried to the workers by those steps.
vLLM's worker processes (the ``mp`` executor) exit on the first SIGINT or
SIGTERM, so the steps of the drain found no worker ("Worker proc ... died
unexpectedly") and the last answers' snapshots were lost.

With the connector, a worker takes the first SIGINT or SIGTERM as notice: it
runs the steps the engine core still sends and exits when vLLM shuts it down
(the engine core closes its workers' pipe when its drain is over), at a second
signal, or ``grace_s`` seconds after the first (the signal is sent again:
vLLM's own handler ends the process), whichever comes first.  Nothing changes
where the worker shares the engine core's process (the ``uni`` executor: the
engine core's handler is vLLM's, left alone).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["AFTER_DRAIN_S", "STOP_SIGNALS", "Notice", "outlive_first_signal",
           "outlive_first_signal_in_worker"]

logger = logging.getLogger("vllm.sparkcache")

#: Seconds a noticed worker waits beyond the engine's ``--shutdown-timeout``
#: (the drain, then the steps that carry its saves) before it stops anyway.
AFTER_DRAIN_S = 10.0
#: The signals a worker takes as notice the first time.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any]


class Notice:
    """The handler of :data:`STOP_SIGNALS`: the first signal starts the grace
    period, the next one (of either kind) goes to the handler it replaced."""

    def __init__(self, previous: dict[int, Handler], grace_s: float) -> None:
        self.previous = previous
        self.grace_s = grace_s
        #: The first signal taken as notice, or None.
        self.noticed: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        if self.noticed is not None:
            return self.previous[signum](signum, frame)
        self.noticed = signum
        logger.info("sparkcache: worker %d got %s; it runs the engine's last steps (their "
                    "saves) and stops with the engine, at a second signal or in %.0f s",
                    os.getpid(), signal.Signals(signum).name, self.grace_s)
        timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return None


def outlive_first_signal(grace_s: float) -> bool:
    """Install :class:`Notice` for :data:`STOP_SIGNALS` in this process (its main
    thread only: Python runs handlers there); whether it is installed.  A
    signal whose handler is not a Python callable (the default action, or
    ignored) is left as it is; installing twice changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current: dict[int, Any] = {int(s): signal.getsignal(s) for s in STOP_SIGNALS}
    if any(isinstance(h, Notice) for h in current.values()):
        return True
    previous = {s: h for s, h in current.items() if callable(h)}
    if not previous:
        return False
    notice = Notice(previous, grace_s)
    for signum in previous:
        signal.signal(signum, notice)
    return True


def outlive_first_signal_in_worker(vllm_config: Any) -> bool:
    """:func:`outlive_first_signal` in a worker of vLLM's ``mp`` executor (a
    process of its own), for the engine's ``shutdown_timeout`` plus
    :data:`AFTER_DRAIN_S`; elsewhere nothing (whether it is installed)."""
    if getattr(vllm_config.parallel_config, "distributed_executor_backend", None) != "mp":
        return False
    drain = float(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    return outlive_first_signal(drain + AFTER_DRAIN_S)
