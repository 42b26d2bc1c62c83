"""One periodic background thread: the retention sweeper's, the shared tier's
sweeper's and the uploader's.

:class:`Periodic` knows nothing of the store: it calls a function, waits, and
calls it again, until it is stopped.  What each user does in a pass, how it
logs a failure and when it may end are the user's, passed in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sparkcache.cpus import widen_affinity

__all__ = ["Periodic"]

log = logging.getLogger(__name__)


class Periodic:
    """Calls ``work`` on a daemon thread named ``name``, at :meth:`start` and
    then every ``interval`` seconds, until :meth:`stop`.

    * The wait runs from the end of one call to the start of the next.
      ``work()`` returns the seconds to wait after it, or None for
      ``interval`` (seconds, or a function read after every call).
    * An ``Exception`` from ``work`` never ends the thread: it is counted in
      :attr:`failures`, kept in :attr:`last_error` and handed to ``on_error``,
      which logs it (default: a warning each time) and returns the wait before
      the next call (None: ``interval``).  A ``BaseException`` ends the thread.
    * :meth:`wake` ends the current wait now; a wake during a call ends the
      wait after that call.
    * :meth:`stop` asks the thread to end, ends its wait and joins it for up to
      ``timeout`` seconds; a call in progress is never interrupted.  It returns
      whether the thread ended, and may be called any number of times.
    * Once stopped, the thread ends as soon as ``until()`` is True, checked
      before and after every call (default: at once); until then it goes on
      calling ``work`` and waiting as before, the stop having ended one wait
      (the uploader empties its queue so, its waits cut to its deadline).
    * :attr:`passes` counts finished calls, failed ones included; :meth:`wait`
      blocks until a number of them finished.
    * The thread first widens its CPU mask (:func:`~sparkcache.cpus.widen_affinity`):
      a thread started from a pinned one would otherwise share its one core.
    """

    def __init__(self, work: Callable[[], float | None], interval: float | Callable[[], float],
                 *, name: str, on_error: Callable[[Exception], float | None] | None = None,
                 until: Callable[[], bool] | None = None) -> None:
        self.name = name
        self._work = work
        self._interval = interval
        self._on_error = on_error or self._log_error
        self._until = until or (lambda: True)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._passed = threading.Condition()
        self.passes = 0
        self.failures = 0
        self.last_error: Exception | None = None

    def start(self) -> Periodic:
        """Start the thread (its first call runs at once); a no-op while it has one."""
        if self._thread is None:
            self._stop.clear()
            self._wake.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """Call ``work`` now rather than after the rest of the wait."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> bool:
        """End the thread (see the class) and join it up to ``timeout`` seconds;
        True when it has ended (or there was none)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        self._thread = None
        return not thread.is_alive()

    close = stop

    def wait(self, passes: int, timeout: float | None = None) -> bool:
        """Block until ``passes`` calls have finished (True) or ``timeout`` ran out."""
        with self._passed:
            return self._passed.wait_for(lambda: self.passes >= passes, timeout)

    @property
    def started(self) -> bool:
        """:meth:`start` was called and :meth:`stop` not since (the thread may
        have ended of a ``BaseException``)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """The thread is alive and not stopped."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called (and :meth:`start` not since)."""
        return self._stop.is_set()

    def _done(self) -> bool:
        return self._stop.is_set() and self._until()

    def _run(self) -> None:
        widen_affinity()
        while not self._done():
            try:
                delay = self._work()
            except Exception as exc:  # a bad pass must not kill the thread
                self.failures += 1
                self.last_error = exc
                delay = self._on_error(exc)
            with self._passed:
                self.passes += 1
                self._passed.notify_all()
            if self._done():
                break
            if delay is None:
                delay = self._interval() if callable(self._interval) else self._interval
            if delay > 0:
                self._wake.wait(delay)
            self._wake.clear()

    def _log_error(self, exc: Exception) -> None:
        log.warning("sparkcache: %s failed: %s", self.name, exc)
