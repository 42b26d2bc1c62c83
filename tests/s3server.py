"""A real S3-protocol server for tests: moto's, on 127.0.0.1 with a free port.

:func:`s3_server` is the session's server, started on first use; a test
package that uses it stops it at the end of the session with
:func:`stop_s3_servers` (its conftest's session fixture).  A test that needs a
server of its own (one it stops, one that checks credentials) makes an
:class:`S3Server` and stops it itself.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

__all__ = ["DelayProxy", "S3Server", "free_port", "s3_calls", "s3_server", "stop_s3_servers"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3 server on 127.0.0.1, and the options that reach it.

    ``env`` goes to the server's environment (``INITIAL_NO_AUTH_ACTION_COUNT=0``
    makes it check credentials).  Unless ``set_env`` is False, the client side's
    ``AWS_ENDPOINT_URL`` and credentials are set to reach it: botocore reads
    them, so a bare ``s3://`` URL (reopened from a backend's url) reaches this
    server as it would a real endpoint set in the environment.
    """

    def __init__(self, *, env: Mapping[str, str] | None = None, set_env: bool = True,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        if set_env:
            os.environ.update(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID="test",
                              AWS_SECRET_ACCESS_KEY="test")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moto's S3 server did not start")
            time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "key": "test", "secret": "test"}

    def bucket(self) -> str:
        """A new, empty bucket."""
        import s3fs

        name = f"sparkcache-{uuid.uuid4().hex[:16]}"
        s3fs.S3FileSystem(**self.options).mkdir(name)
        return name

    def buckets(self) -> list[str]:
        import s3fs

        return [str(b) for b in s3fs.S3FileSystem(**self.options).ls("", refresh=True)]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_S3: list[S3Server] = []


def s3_server() -> S3Server:
    """The session's S3 server, started on first use."""
    if not _S3:
        _S3.append(S3Server())
    return _S3[0]


def stop_s3_servers() -> None:
    """Stop the session's server, if it was started."""
    while _S3:
        _S3.pop().stop()


@contextmanager
def s3_calls(fs: Any) -> Iterator[Counter[str]]:
    """Count the S3 API calls an s3fs filesystem makes meanwhile, by operation
    (``PutObject``, ``HeadObject``, ``CreateMultipartUpload``, ...): botocore's
    own event, so every request is seen, whichever s3fs path sent it."""
    fs.connect()
    calls: Counter[str] = Counter()

    def count(model: Any, **_: Any) -> None:
        calls[model.name] += 1

    fs.s3.meta.events.register("before-call.s3", count)
    try:
        yield calls
    finally:
        fs.s3.meta.events.unregister("before-call.s3", count)


class _Pacer:
    """Paces the bytes of every connection through it to one rate: a link of
    that bandwidth, shared by all of them (one per direction)."""

    def __init__(self) -> None:
        self._free_at = 0.0  # monotonic: when the link has sent what it was given
        self._lock = threading.Lock()

    def wait(self, nbytes: int, rate: float | None, stop: threading.Event) -> bool:
        """Hold ``nbytes`` until the link at ``rate`` bytes/s has carried them
        after what it was given before (None: at once); True when stopped."""
        if not rate:
            return False
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / rate
            until = self._free_at
        return stop.wait(until - now)


class DelayProxy:
    """A TCP proxy on 127.0.0.1 to ``port``: a slow endpoint (every request, on
    new and kept-alive connections), made of real sockets.  ``delay``: every
    piece a client sends is held that many seconds before it is forwarded.
    ``rate``: bytes per second each way, all connections together (a link of
    that bandwidth; None: as fast as loopback).  Both may be changed while it
    runs; :meth:`wait_idle` waits until nothing moves; :meth:`stop` closes
    everything."""

    def __init__(self, port: int, delay: float = 0.0, *, rate: float | None = None) -> None:
        self.target, self.delay, self.rate = port, delay, rate
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._pacers = {True: _Pacer(), False: _Pacer()}  # client -> server, and back
        self._moved_at = time.monotonic()  # the last byte forwarded either way
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_idle(self, quiet: float = 0.5, timeout: float = 60.0) -> bool:
        """Wait until no byte went through for ``quiet`` seconds (True), or
        ``timeout`` ran out (False)."""
        deadline = time.monotonic() + timeout
        while (idle := time.monotonic() - self._moved_at) < quiet:
            if time.monotonic() + quiet - idle > deadline:
                return False
            time.sleep(quiet - idle)
        return True

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        self._open += [client, upstream]
        for a, b, up in ((client, upstream, True), (upstream, client, False)):
            threading.Thread(target=self._pipe, args=(a, b, up), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        pacer = self._pacers[up]
        try:
            while data := src.recv(65536):
                if up and self._stop.wait(self.delay):
                    break
                if pacer.wait(len(data), self.rate, self._stop):
                    break
                dst.sendall(data)
                self._moved_at = time.monotonic()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        for s in self._open:
            s.close()
