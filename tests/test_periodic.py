"""Periodic, the one periodic background thread: it runs at once and then every
interval, wakes early, survives a failing call, stops within its join bound and
is stopped any number of times."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sparkcache.periodic import Periodic


class Calls:
    """A work function that records when it ran and may be told to fail."""

    def __init__(self, delay: float | None = None) -> None:
        self.times: list[float] = []
        self.fail = 0  # the next this many calls raise
        self.delay = delay

    def __call__(self) -> float | None:
        self.times.append(time.monotonic())
        if self.fail:
            self.fail -= 1
            raise RuntimeError("boom")
        return self.delay


def test_it_runs_at_once_then_every_interval_and_stops_promptly() -> None:
    calls = Calls()
    started = time.monotonic()
    periodic = Periodic(calls, 0.05, name="test-periodic").start()
    try:
        assert periodic.started and periodic.running
        assert periodic.wait(4, timeout=10)
        assert calls.times[0] - started < 1.0  # the first call does not wait
        gaps = [b - a for a, b in zip(calls.times, calls.times[1:], strict=False)]
        assert all(gap >= 0.045 for gap in gaps), gaps
        assert threading.current_thread().name != "test-periodic"
        assert "test-periodic" in {t.name for t in threading.enumerate()}
    finally:
        before = time.monotonic()
        assert periodic.stop(timeout=5)
    assert time.monotonic() - before < 1.0  # a stop ends the wait, not after it
    assert not periodic.running and not periodic.started and periodic.stopping
    passes = periodic.passes
    time.sleep(0.15)
    assert periodic.passes == passes  # stopped means no more calls
    assert periodic.stop() and periodic.stop(timeout=0)  # idempotent
    assert not {t.name for t in threading.enumerate()} & {"test-periodic"}


def test_a_long_interval_does_not_delay_a_stop() -> None:
    periodic = Periodic(Calls(), 3600, name="test-periodic-long").start()
    assert periodic.wait(1, timeout=10)
    before = time.monotonic()
    assert periodic.stop(timeout=5)
    assert time.monotonic() - before < 1.0


def test_wake_runs_it_early() -> None:
    calls = Calls()
    with_wake = Periodic(calls, 3600, name="test-periodic-wake").start()
    try:
        assert with_wake.wait(1, timeout=10)
        assert not with_wake.wait(2, timeout=0.2)  # the hour is not over
        with_wake.wake()
        assert with_wake.wait(2, timeout=5)
    finally:
        with_wake.stop(timeout=5)


def test_an_exception_is_counted_logged_and_does_not_kill_it(
        caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls()
    calls.fail = 2
    with caplog.at_level(logging.WARNING, logger="sparkcache.periodic"):
        periodic = Periodic(calls, 0.01, name="test-periodic-fail").start()
        try:
            assert periodic.wait(4, timeout=10)
            assert periodic.running
        finally:
            periodic.stop(timeout=5)
    assert periodic.failures == 2
    assert isinstance(periodic.last_error, RuntimeError)
    assert [r.getMessage() for r in caplog.records] == [
        "sparkcache: test-periodic-fail failed: boom"] * 2


def test_on_error_chooses_the_wait_and_work_may_return_its_own() -> None:
    calls = Calls(delay=3600)  # after a call that works: an hour
    calls.fail = 1
    seen: list[Exception] = []

    def on_error(exc: Exception) -> float:
        seen.append(exc)
        return 0.0  # after a failure: at once

    periodic = Periodic(calls, 0.01, name="test-periodic-delays", on_error=on_error).start()
    try:
        assert periodic.wait(2, timeout=10)  # the failure did not wait
        assert not periodic.wait(3, timeout=0.3)  # the success's own hour did
    finally:
        periodic.stop(timeout=5)
    assert [str(e) for e in seen] == ["boom"]


def test_the_interval_may_be_read_after_every_call() -> None:
    interval = [3600.0]
    periodic = Periodic(Calls(), lambda: interval[0], name="test-periodic-read").start()
    try:
        assert periodic.wait(1, timeout=10)
        interval[0] = 0.01
        periodic.wake()  # the hour's wait ends; the next one is read anew
        assert periodic.wait(5, timeout=10)
    finally:
        periodic.stop(timeout=5)


def test_until_keeps_it_running_after_stop_until_it_holds() -> None:
    calls = Calls(delay=3600)  # the first wait: an hour, ended by the stop
    periodic = Periodic(calls, 3600, name="test-periodic-until",
                        until=lambda: len(calls.times) >= 3).start()
    assert periodic.wait(1, timeout=10)
    calls.delay = 0.01  # the waits after the stop are work's own
    assert periodic.stop(timeout=10)  # it calls again until until() holds
    assert len(calls.times) == 3


def test_stop_gives_up_after_its_timeout_on_a_call_that_hangs() -> None:
    release = threading.Event()
    entered = threading.Event()

    def hang() -> None:
        entered.set()
        release.wait(30)

    periodic = Periodic(hang, 0.01, name="test-periodic-hang").start()
    try:
        assert entered.wait(10)
        before = time.monotonic()
        assert not periodic.stop(timeout=0.2)  # the call in progress is not interrupted
        assert 0.15 < time.monotonic() - before < 2.0
    finally:
        release.set()


def test_it_can_be_started_again_after_a_stop() -> None:
    periodic = Periodic(Calls(), 3600, name="test-periodic-again")
    assert periodic.stop()  # never started
    periodic.start()
    assert periodic.start().wait(1, timeout=10)  # a second start is a no-op
    periodic.stop(timeout=5)
    periodic.start()
    try:
        assert periodic.wait(2, timeout=10) and periodic.running
    finally:
        periodic.stop(timeout=5)
