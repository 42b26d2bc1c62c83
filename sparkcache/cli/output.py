"""What every ``sparkcache`` command shares: its context, output and exit status.

A command gets a :class:`Context` (the parsed arguments, the streams, the store
to open, a person to ask) and prints through it: :meth:`Context.emit` writes the
admin result as JSON under ``--json`` and the command's text otherwise,
:meth:`Context.emit_lines` one JSON object per line (a log), and
:meth:`Context.bar` draws a :class:`ProgressBar` on stderr.  The text helpers
(:func:`table`, :func:`fields`, :func:`when`, :func:`plural`) format the
results for people.  A command returns one of the exit statuses of
:data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TextIO

from sparkcache import admin

__all__ = [
    "EXIT_CODES", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_STORE", "EXIT_USAGE",
    "Context", "Declined", "ProgressBar", "fields", "plural", "table", "when",
]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_INTERRUPTED = 130
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_PROBLEMS: "problems found: check found issues (also when --fix repaired them), verify "
                   "found corrupt snapshots, export left some out, import or upload refused "
                   "some, shared-sweep skipped (another host sweeps), the index schema is "
                   "behind (db current), or clear was not confirmed",
    EXIT_USAGE: "usage error: bad arguments (an unknown URL scheme included), the store, "
                "model, snapshot, shared tier bucket or folder named does not exist, a "
                "quarantined snapshot to pin, upload or shared-sweep without a shared tier, "
                "a tier shared-sweep cannot hold alone, or clear "
                "without a terminal to confirm on and without --yes",
    EXIT_STORE: "store error: schema mismatch (an index written by a newer sparkcache, a file "
                "that is not a sparkcache index, or an index behind that a read-only command "
                "will not upgrade), a storage or shared tier other than the one the store "
                "recorded, index locked too long (StoreTimeout), storage or I/O failure (a "
                "shared tier unreachable or refusing the credentials included), lease conflict",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


# -- text for people ------------------------------------------------------------------


def when(t: float | None) -> str:
    """Unix seconds as the index views show them: UTC ``YYYY-MM-DD HH:MM:SS``."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
          widths: Sequence[int] = (), right: Sequence[bool] = (), header: bool = True) -> str:
    """Columns aligned to their widest cell; numbers right-aligned, text left.

    For tables printed one after another (a log followed) to line up, give
    ``widths``, the least widths of the columns, and ``right``, which columns
    are right-aligned whatever the cells hold.  ``header=False`` leaves out
    the header line.  Every cell is printed with control and format characters
    escaped (:func:`sparkcache.admin.printable`): a name from a request or a
    model's config never forges a line.
    """
    cells = [[("-" if v is None else _printable(v)) for v in row] for row in rows]
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    numeric = list(right) or [any(number(row[i]) for row in rows)
                              and all(number(row[i]) or row[i] is None for row in rows)
                              for i in range(len(headers))]
    least = [*widths, *[0] * (len(headers) - len(widths))]
    sizes = [max([len(h), least[i], *(len(r[i]) for r in cells)])
             for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w)
                 for v, w, num in zip(values, sizes, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([*([line(headers)] if header else []), *(line(r) for r in cells)])


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """``name:  value`` lines with the values aligned, printed as :func:`table`'s cells."""
    width = max(len(k) for k, _v in pairs) + 1
    return "\n".join(f"{k + ':':<{width}}  {'-' if v is None else _printable(v)}"
                     for k, v in pairs)


def _printable(value: Any) -> str:
    """``value`` as text with control and format characters escaped."""
    return admin.printable(str(value)) or ""


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class ProgressBar:
    """``label [#####.....]  42%  12.3/29.0 MB  85.1 MB/s`` redrawn in place on a stream.

    Called as ``bar(done, total)`` (the admin progress callback); redraws at most
    ten times a second.  ``spin()`` shows elapsed time for work without a total.
    Disabled bars do nothing.
    """

    WIDTH = 28

    def __init__(self, label: str, stream: IO[str], enabled: bool) -> None:
        self.label = label
        self.stream = stream
        self.enabled = enabled
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._state = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        self._state = (done, total)
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or (total and done >= total)):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        done, total = self._state
        elapsed = max(time.monotonic() - self.start, 1e-9)
        if total > 0:
            frac = min(done / total, 1.0)
            bar = "#" * int(frac * self.WIDTH)
            text = (f"{self.label} [{bar:.<{self.WIDTH}}] {frac:4.0%}  "
                    f"{done / 1e6:.1f}/{total / 1e6:.1f} MB  {done / 1e6 / elapsed:.1f} MB/s")
        else:
            text = f"{self.label} ... {elapsed:.1f} s"
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled and self._drawn:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    @contextlib.contextmanager
    def spin(self) -> Iterator[None]:
        """Redraw the elapsed time from a thread while the body runs."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(0.2):
                self._draw()

        thread = threading.Thread(target=run, daemon=True) if self.enabled else None
        if thread is not None:
            self._draw()
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join()
            self.close()


class Declined(Exception):
    """The user answered no: nothing was changed."""


@dataclass
class Context:
    """What a command needs besides its arguments."""

    args: argparse.Namespace
    out: TextIO
    err: TextIO
    inp: TextIO = field(default_factory=lambda: sys.stdin)  # where confirmations are read

    @property
    def folder(self) -> Path:
        return admin.resolve_folder(self.args.folder)

    @property
    def shared(self) -> str | None:
        """The shared tier given (``--shared``, else ``SPARK_KV_CACHE_SHARED``)."""
        return admin.resolve_shared(self.args.shared)

    @contextlib.contextmanager
    def store(self, *, create: bool = False, upgrade: bool = True,
              tier: bool = False) -> Iterator[admin.SnapshotStore]:
        """The store; ``upgrade=False`` for commands that must not change it.

        ``tier``: the command uses the shared tier (``--shared``, else
        ``SPARK_KV_CACHE_SHARED``).  Other commands open it only when ``--shared``
        is given on their command line (checked, and recorded with
        ``--relocate``): a tier set in the environment is never contacted by a
        command that does not need it."""
        shared = self.shared if tier else self.args.shared
        store = admin.open_store(self.folder, storage=self.args.storage, create=create,
                                 upgrade=upgrade, relocate=self.args.relocate, shared=shared)
        try:
            yield store
        finally:
            store.close()

    @property
    def interactive(self) -> bool:
        """Whether there is a person to ask: stdin is a terminal."""
        try:
            return self.inp.isatty()
        except (AttributeError, ValueError):  # no stdin, or a closed one
            return False

    def confirm(self, question: str) -> bool:
        """Ask on stderr, read the answer from stdin; only y or yes says yes."""
        self.err.write(f"{question} [y/N] ")
        self.err.flush()
        return self.inp.readline().strip().lower() in ("y", "yes")

    def bar(self, label: str) -> ProgressBar:
        enabled = self.args.progress
        if enabled is None:
            enabled = self.err.isatty()
        return ProgressBar(label, self.err, bool(enabled))

    def emit(self, result: Any, text: Callable[[], str]) -> None:
        """Print ``result`` as JSON with --json, else ``text()``."""
        if self.args.json:
            self.out.write(json.dumps(admin.to_dict(result), indent=2, sort_keys=True) + "\n")
        else:
            body = text()
            if body:
                self.out.write(body + "\n")

    def emit_lines(self, results: Sequence[Any]) -> None:
        """Print each result as one line of JSON (for a log: ``jq`` reads it as it
        comes), and flush."""
        for result in results:
            self.out.write(json.dumps(admin.to_dict(result), sort_keys=True) + "\n")
        self.out.flush()
