"""The right to sweep a shared tier, held by one host at a time.

:class:`SweepLease` (docs/shared.md, "The sweep"):

* on S3 (and S3-protocol stores that honour conditional writes), the object
  ``sweep.json`` is created with If-None-Match and renewed, released or taken
  over (once expired) with If-Match on its ETag, so of several hosts exactly
  one holds it, and a holder whose renewal fails knows another took over;
* on a ``file://`` tier, an open-file-description lock on ``sweep.lock``
  (a POSIX lock where Linux lacks those), which the kernel or the NFS server
  drops when the process dies; ``sweep.json`` then only records who holds it;
* any other filesystem is refused.

``sweep.json`` names the holder, its expiry and when the last sweep finished,
so that a fleet whose every host runs the periodic sweeper sweeps about once
per period.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sparkcache.backends import ObjectStore
from sparkcache.errors import InvalidArgument, LeaseError, SparkCacheError
from sparkcache.holders import this_holder
from sparkcache.identity import canonical_json
from sparkcache.shared.tier import SharedTier

__all__ = ["LEASE_FORMAT", "LEASE_KEY", "LOCK_KEY", "LeaseState", "SweepLease", "read_lease"]

#: The lease object (S3) and the lock file (file://) at the tier's root.
LEASE_KEY = "sweep.json"
LOCK_KEY = "sweep.lock"
LEASE_FORMAT = "sparkcache-shared-sweep"


def _lock(fd: int) -> None:
    """Lock the whole file without waiting (OSError EAGAIN/EACCES when another
    holds it): an open-file-description lock where Linux has them, so that two
    sweeps in one process exclude each other too, and the kernel (or the NFS
    server) drops it when the process dies; else a POSIX record lock."""
    import fcntl  # POSIX only: a file:// tier is swept from a POSIX host

    ofd = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd is None:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    fcntl.fcntl(fd, ofd, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))


def _lease_bytes(holder: str, expires_at: float, finished_at: float | None) -> bytes:
    return canonical_json({"format": LEASE_FORMAT, "holder": holder,
                           "expires_at": round(expires_at, 3),
                           "finished_at": None if finished_at is None
                           else round(finished_at, 3)}).encode()


@dataclass(frozen=True)
class LeaseState:
    """What ``sweep.json`` says: who holds the sweep until when, and when the last
    sweep finished (None: never)."""

    holder: str
    expires_at: float
    finished_at: float | None


def read_lease(raw: bytes | None) -> LeaseState | None:
    """The lease, or None when there is none or it is unreadable (then free)."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if doc.get("format") != LEASE_FORMAT:
            return None
        finished = doc.get("finished_at")
        return LeaseState(str(doc["holder"]), float(doc["expires_at"]),
                          None if finished is None else float(finished))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class SweepLease:
    """The right to sweep a tier, held by one host at a time (see the module doc).

    :meth:`take` returns the lease or the reason it was not taken; a holder
    calls :meth:`renew` before each batch of deletions (:class:`LeaseError`
    when another host took it over: stop) and :meth:`release` at the end.
    """

    def __init__(self, tier: SharedTier, holder: str, seconds: float,
                 clock: Callable[[], float], *, etag: str | None = None,
                 fd: int | None = None, finished_at: float | None = None) -> None:
        self.tier = tier
        self.holder = holder
        self.seconds = seconds
        self.clock = clock
        self.etag = etag
        self.fd = fd
        self.previous_finish = finished_at

    @classmethod
    def take(cls, tier: SharedTier, *, seconds: float, clock: Callable[[], float],
             min_interval: float = 0.0) -> tuple[SweepLease | None, str | None]:
        """``(lease, None)``, or ``(None, why)``: another host holds it, or (with
        ``min_interval``) a sweep finished less than that many seconds ago."""
        backend: ObjectStore = tier.backend
        holder = f"{this_holder()}/{uuid.uuid4().hex[:8]}"
        now = clock()
        if backend.conditional_writes:
            etag = backend.etag(LEASE_KEY)
            prev = None if etag is None else read_lease(tier.get(LEASE_KEY))
            why = cls._busy(prev, now, min_interval)
            if why is not None:
                return None, why
            new = backend.put_conditional(
                LEASE_KEY, _lease_bytes(holder, now + seconds,
                                        None if prev is None else prev.finished_at), etag)
            if new is None:
                return None, "another host took the sweep lease at the same moment"
            return cls(tier, holder, seconds, clock, etag=new,
                       finished_at=None if prev is None else prev.finished_at), None
        path = backend.local_path(LOCK_KEY)
        if path is None:
            raise InvalidArgument(
                f"the shared tier {tier.url} offers no way for one host to hold the sweep "
                "alone: sweeping needs an S3 (or S3-protocol) store with conditional writes, "
                "or a file:// tier on a filesystem with POSIX locks")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise LeaseError(f"cannot lock {path} to sweep {tier.url}: {exc}; check that "
                                 "the shared filesystem supports POSIX locks") from exc
            prev = read_lease(tier.get(LEASE_KEY))
            return None, f"{prev.holder if prev else 'another process'} is sweeping the tier"
        prev = read_lease(tier.get(LEASE_KEY))
        why = cls._busy(None if prev is None else LeaseState(prev.holder, 0, prev.finished_at),
                        now, min_interval)
        if why is not None:
            os.close(fd)  # drops the lock
            return None, why
        lease = cls(tier, holder, seconds, clock, fd=fd,
                    finished_at=None if prev is None else prev.finished_at)
        tier.put(LEASE_KEY, [_lease_bytes(holder, now + seconds, lease.previous_finish)])
        return lease, None

    @staticmethod
    def _busy(prev: LeaseState | None, now: float, min_interval: float) -> str | None:
        if prev is None:
            return None
        if prev.expires_at > now:
            return f"{prev.holder} is sweeping the tier (its lease runs until " \
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(prev.expires_at))} UTC)"
        if min_interval > 0 and prev.finished_at is not None \
                and now - prev.finished_at < min_interval:
            return f"the tier was swept {now - prev.finished_at:.0f} s ago"
        return None

    def renew(self) -> None:
        """Extend the lease; LeaseError when another host took it over (its holder
        saw it expired): stop sweeping."""
        if self.fd is not None:
            return  # the POSIX lock holds until released or the process dies
        new = self.tier.backend.put_conditional(
            LEASE_KEY, _lease_bytes(self.holder, self.clock() + self.seconds,
                                    self.previous_finish), self.etag)
        if new is None:
            raise LeaseError(f"the sweep lease of {self.tier.url} was taken over by another "
                             "host (this one ran past its lease: check the hosts' clocks and "
                             "the tier's latency); this sweep stopped, the other goes on")
        self.etag = new

    def release(self, finished: bool) -> None:
        """Give the lease back; ``finished`` records the end of a whole sweep."""
        done = self.clock() if finished else self.previous_finish
        state = _lease_bytes(self.holder, 0.0, done)
        if self.fd is not None:
            try:
                self.tier.put(LEASE_KEY, [state])
            finally:
                os.close(self.fd)  # drops the lock
                self.fd = None
            return
        with contextlib.suppress(SparkCacheError):
            self.tier.backend.put_conditional(LEASE_KEY, state, self.etag)
