"""The ``sparkcache`` command: a thin layer over :mod:`sparkcache.admin`.

Each subcommand parses its arguments, calls one admin function and prints the
result: an aligned table for people, or the admin result as JSON with
``--json``.  Long commands (verify, export, import, sweep) draw a progress bar
on stderr when stderr is a terminal or ``--progress`` is given.  Errors print
one line on stderr, ``sparkcache: error: <message>`` (with ``--json``, a JSON
object: ``error``, ``message``, ``exit_code``), never a traceback (``--debug``
shows it), and the exit status says what happened (:data:`EXIT_CODES`).

Read-only commands (models, ls, show, stats, check without --fix) and every
``--dry-run`` open the store without upgrading its schema; commands that delete
(clear, rm, sweep, check --fix) can rehearse with ``--dry-run``, and ``clear``
asks first on a terminal.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NoReturn, TextIO

from sparkcache import admin
from sparkcache.errors import InvalidArgument, NotFound, SparkCacheError

__all__ = ["EXIT_CODES", "build_parser", "main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_INTERRUPTED = 130
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_PROBLEMS: "problems found: check found issues (also when --fix repaired them), verify "
                   "found corrupt snapshots, export left some out, import refused some, the "
                   "index schema is behind (db current), or clear was not confirmed",
    EXIT_USAGE: "usage error: bad arguments (an unknown URL scheme included), the store, "
                "model or snapshot named does not exist, a quarantined snapshot to pin, or "
                "clear without a terminal to confirm on and without --yes",
    EXIT_STORE: "store error: schema mismatch (an index written by a newer sparkcache, a file "
                "that is not a sparkcache index, or an index behind that a read-only command "
                "will not upgrade), a storage other than the one the store recorded, index "
                "locked too long (StoreTimeout), storage or I/O failure, lease conflict",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
EPILOG = "exit codes:\n" + "\n".join(
    textwrap.fill(text, 79, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    for code, text in EXIT_CODES.items())
FOLDER_HELP = (
    "the store's folder (default: $SPARK_KV_CACHE_FOLDER, else $SPARK_STORAGE/kvcache, else "
    "~/.local/share/spark/kvcache)"
)


# -- output ---------------------------------------------------------------------------


def when(t: float | None) -> str:
    """Unix seconds as the index views show them: UTC ``YYYY-MM-DD HH:MM:SS``."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned to their widest cell; numbers right-aligned, text left."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    numeric = [any(number(row[i]) for row in rows)
               and all(number(row[i]) or row[i] is None for row in rows)
               for i in range(len(headers))]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w)
                 for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """``name:  value`` lines with the values aligned."""
    width = max(len(k) for k, _v in pairs) + 1
    return "\n".join(f"{k + ':':<{width}}  {'-' if v is None else v}" for k, v in pairs)


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

    @contextlib.contextmanager
    def store(self, *, create: bool = False,
              upgrade: bool = True) -> Iterator[admin.SnapshotStore]:
        """The store; ``upgrade=False`` for commands that must not change it."""
        store = admin.open_store(self.folder, storage=self.args.storage, create=create,
                                 upgrade=upgrade, relocate=self.args.relocate)
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


# -- commands -------------------------------------------------------------------------


def cmd_models(ctx: Context) -> int:
    with ctx.store(upgrade=False) as store:
        rows = admin.list_models(store)
    ctx.emit(rows, lambda: table(
        ["ID", "NAME", "DIGEST", "SNAPSHOTS", "MB", "CREATED", "DELETED"],
        [[r.id, r.name, r.digest[:12], r.snapshots, r.mb, when(r.created_at),
          when(r.deleted_at) if r.deleted_at else None] for r in rows],
    ) if rows else "no models")
    return EXIT_OK


def _snapshot_table(rows: Sequence[admin.SnapshotRow]) -> str:
    return table(
        ["ID", "MODEL", "TOKENS", "MB", "CREATED", "LAST USED", "HITS", "PARENT", "PINNED",
         "STATE", "REASON"],
        [[r.id, r.model, r.tokens, r.mb, when(r.created_at), when(r.last_used), r.hits,
          r.parent, "yes" if r.pinned else "", r.state, r.reason] for r in rows],
    )


def cmd_ls(ctx: Context) -> int:
    with ctx.store(upgrade=False) as store:
        rows = admin.list_snapshots(store, ctx.args.model)
    ctx.emit(rows, lambda: _snapshot_table(rows) if rows else "no snapshots")
    return EXIT_OK


def cmd_show(ctx: Context) -> int:
    with ctx.store(upgrade=False) as store:
        d = admin.show(store, ctx.args.id)
    s = d.snapshot

    def text() -> str:
        head = fields([
            ("snapshot", s.id), ("model", f"{s.model} (id {s.model_id}, {d.model_digest})"),
            ("state", s.state + (f" ({s.reason})" if s.reason else "")),
            ("tokens", f"{s.tokens} (this link holds [{s.start_token}, {s.tokens}))"),
            ("size", f"{s.mb} MB ({s.nbytes} bytes)"), ("ranks", s.world_size),
            ("parent", s.parent), ("depth", s.depth), ("pinned", "yes" if s.pinned else "no"),
            ("hits", s.hits), ("created", when(s.created_at)), ("last used", when(s.last_used)),
            ("chain", " -> ".join(f"{c.id}[{c.start_token}:{c.n_tokens}]" for c in d.chain)),
            ("children", ", ".join(map(str, d.children)) or None),
        ])
        segs = table(["RANK", "STATE", "TOKENS", "MB", "DIGEST", "FILE"],
                     [[g.rank, g.state, f"{g.token_start}-{g.token_end}", admin.mb(g.nbytes),
                       g.digest, g.object_key] for g in d.segments])
        parts = [head, "", segs]
        if d.leases:
            parts += ["", table(["LEASE", "KIND", "HOLDER", "EXPIRES"],
                                [[x.id, x.kind, x.holder, when(x.expires_at)] for x in d.leases])]
        return "\n".join(parts)

    ctx.emit(d, text)
    return EXIT_OK


def cmd_stats(ctx: Context) -> int:
    with ctx.store(upgrade=False) as store:
        st = admin.stats(store, ctx.args.model)

    def text() -> str:
        rate = "-" if st.hit_rate is None else f"{st.hit_rate:.1%}"
        pairs: list[tuple[str, Any]] = [
            ("model", st.model or "(all)"), ("hits", st.hits), ("misses", st.misses),
            ("hit rate", rate), ("publishes", st.publishes), ("skipped", st.skipped),
            ("written", f"{st.written_tokens} tokens, {admin.mb(st.written_bytes)} MB"),
            ("restored", f"{st.restored_tokens} tokens, {admin.mb(st.restored_bytes)} MB"),
            ("evictions", ", ".join(f"{k} {v}" for k, v in st.evictions.items()) or 0),
            ("quarantines", ", ".join(f"{k} {v}" for k, v in st.quarantined_counts.items())
             or 0),
        ]
        body = fields(pairs)
        if st.quarantined:
            body += "\n\nquarantined now:\n" + _snapshot_table(st.quarantined)
        return body

    ctx.emit(st, text)
    return EXIT_OK


def cmd_verify(ctx: Context) -> int:
    if ctx.args.requeue:
        return _requeue(ctx)
    with ctx.store() as store:
        bar = ctx.bar("verify")
        try:
            report = admin.verify(store, progress=bar)
        finally:
            bar.close()

    def text() -> str:
        head = (f"verified {plural(report.segments, 'segment')} ({admin.mb(report.nbytes)} MB): "
                + ("all intact" if report.clean else
                   f"{len(report.corrupt)} corrupt, quarantined: "
                   + ", ".join(map(str, report.quarantined))))
        if report.clean:
            return head
        return head + "\n" + table(["SNAPSHOT", "RANK", "REASON", "MESSAGE"],
                                   [[p.snapshot_id, p.rank, p.reason, p.message]
                                    for p in report.corrupt])

    ctx.emit(report, text)
    return EXIT_OK if report.clean else EXIT_PROBLEMS


def _requeue(ctx: Context) -> int:
    with ctx.store() as store, ctx.bar("requeue").spin():
        r = admin.requeue(store)

    def text() -> str:
        head = (f"requeued {plural(len(r.requeued), 'snapshot')}"
                + (": " + ", ".join(map(str, r.requeued)) if r.requeued else ""))
        if not r.still_quarantined:
            return head
        return head + "\nstill quarantined:\n" + _problems(r.still_quarantined)

    ctx.emit(r, text)
    return EXIT_OK if not r.still_quarantined else EXIT_PROBLEMS


def _report(result: Any) -> Any:
    """The report of a result that may be a dry run's."""
    return result.report if isinstance(result, admin.DryRun) else result


def _would(dry: bool, done: str, would: str) -> str:
    return would if dry else done


def _dry_note(result: Any) -> str:
    """The last line of a dry run's text: what would go; "" for a real run."""
    if not isinstance(result, admin.DryRun):
        return ""
    return (f"\ndry run: nothing was changed ({plural(len(result.files), 'file')}"
            + (f" and {plural(len(result.folders), 'folder')}" if result.folders else "")
            + " would be deleted)")


def cmd_check(ctx: Context) -> int:
    fix, dry = ctx.args.fix, ctx.args.dry_run
    with ctx.store(upgrade=fix and not dry) as store, ctx.bar("check").spin():
        result = admin.check(store, fix=fix, dry_run=dry)
    report = _report(result)

    def text() -> str:
        if report.clean:
            return "index and files agree: nothing to fix" + _dry_note(result)
        found: list[tuple[str, list[Any]]] = [
            ("expired leases", report.expired_leases),
            ("publishes whose process died (snapshot, rank)", report.dead_publishes),
            ("snapshots stuck pending", report.stuck_pending),
            ("snapshots whose file is missing", report.missing_files),
            ("files no row names", report.orphan_files),
        ]
        lines = [f"{name}: {len(items)}  {', '.join(map(str, items[:10]))}"
                 + (" ..." if len(items) > 10 else "") for name, items in found if items]
        if not fix:
            lines.append("run `sparkcache check --fix` to repair.")
        else:
            lines.append(_would(dry, "fixed.", "--fix would repair all of it."))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK if report.clean else EXIT_PROBLEMS


def cmd_clear(ctx: Context) -> int:
    a = ctx.args
    if not (a.yes or a.dry_run or ctx.interactive):
        raise InvalidArgument(
            f"`sparkcache clear {a.model}` deletes every snapshot of the model and there is "
            "no terminal to ask on: pass --yes to go ahead (--dry-run shows what would go)")
    with ctx.store(upgrade=not a.dry_run) as store:
        if not (a.yes or a.dry_run):
            plan = admin.clear_model(store, a.model, keep_pinned=a.keep_pinned,
                                     dry_run=True).report
            if plan.deleted and not ctx.confirm(
                    f"delete {plural(len(plan.deleted), 'snapshot')} of {plan.model} "
                    f"(id {plan.model_id})?"):
                raise Declined("not confirmed: nothing was deleted")
        with ctx.bar("clear").spin():
            result = admin.clear_model(store, a.model, keep_pinned=a.keep_pinned,
                                       dry_run=a.dry_run)
    r = _report(result)
    dry = a.dry_run

    def text() -> str:
        lines = [f"{_would(dry, 'deleted', 'would delete')} "
                 f"{plural(len(r.deleted), 'snapshot')} of {r.model} (id {r.model_id})"
                 + (": " + ", ".join(map(str, r.deleted)) if dry and r.deleted else "")]
        if r.kept_leased:
            lines.append(f"{_would(dry, 'kept', 'would keep')} {len(r.kept_leased)} in use "
                         "(leased, or needed by a leased one): "
                         + ", ".join(map(str, r.kept_leased)) + "; clear again later")
        if r.kept_pinned:
            lines.append(f"{_would(dry, 'kept', 'would keep')} pinned: "
                         + ", ".join(map(str, r.kept_pinned)))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK


def cmd_rm(ctx: Context) -> int:
    dry = ctx.args.dry_run
    with ctx.store(upgrade=not dry) as store, ctx.bar("rm").spin():
        result = admin.delete_model(store, ctx.args.model, dry_run=dry)
    r = _report(result)
    ctx.emit(result, lambda: (
        f"{_would(dry, 'deleted', 'would delete')} model {r.model} (id {r.model_id}) and its "
        "folder" if r.complete else
        f"model {r.model} (id {r.model_id}) {_would(dry, 'is', 'would be')} marked deleted; "
        f"{plural(len(r.remaining), 'snapshot')} still leased go when their leases end "
        "(the sweeper finishes the job)") + _dry_note(result))
    return EXIT_OK


def cmd_pin(ctx: Context) -> int:
    with ctx.store() as store:
        row = admin.pin(store, ctx.args.id) if ctx.args.command == "pin" else \
            admin.unpin(store, ctx.args.id)
    ctx.emit(row, lambda: f"snapshot {row.id} {'pinned' if row.pinned else 'unpinned'}")
    return EXIT_OK


def cmd_sweep(ctx: Context) -> int:
    overrides = {k: v for k, v in (("max_age_hours", ctx.args.max_age_hours),
                                   ("total_mb", ctx.args.total_mb),
                                   ("min_free_mb", ctx.args.min_free_mb)) if v is not None}
    settings = admin.retention_settings(ctx.folder, **overrides)
    dry = ctx.args.dry_run
    with ctx.store(upgrade=not dry) as store, ctx.bar("sweep").spin():
        result = admin.sweep(store, settings, dry_run=dry)
    r = _report(result)

    def text() -> str:
        if not r.count and not r.folders_removed:
            return "nothing to sweep" + _dry_note(result)
        lines = [f"{_would(dry, 'evicted', 'would evict')} {n} ({reason})"
                 for reason, n in r.counts().items()]
        if r.models_removed:
            lines.append(_would(dry, "models removed: ", "models that would be removed: ")
                         + ", ".join(r.models_removed))
        if r.folders_removed:
            lines.append(_would(dry, "folders removed: ", "folders that would be removed: ")
                         + str(len(r.folders_removed)))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK


def _problems(items: Sequence[admin.Problem]) -> str:
    return table(["SNAPSHOT", "RANK", "REASON", "MESSAGE"],
                 [[p.snapshot_id, p.rank, p.reason, p.message] for p in items])


def cmd_export(ctx: Context) -> int:
    with ctx.store() as store:
        bar = ctx.bar("export")
        try:
            r = admin.export_model(store, ctx.args.model, ctx.args.dest, progress=bar)
        finally:
            bar.close()
    ctx.emit(r, lambda: (
        f"exported {plural(len(r.snapshots), 'snapshot')} of {r.model} "
        f"({plural(r.segments, 'file')}, "
        f"{admin.mb(r.nbytes)} MB) to {r.dest}"
        + (f"\nleft out {len(r.skipped)}:\n{_problems(r.skipped)}" if r.skipped else "")))
    return EXIT_PROBLEMS if r.skipped else EXIT_OK


def cmd_import(ctx: Context) -> int:
    bar = ctx.bar("import")
    try:  # import_into creates the store, and removes it again if nothing was imported
        r = admin.import_into(ctx.folder, ctx.args.src, storage=ctx.args.storage, progress=bar)
    finally:
        bar.close()
    ctx.emit(r, lambda: (
        f"imported {plural(len(r.imported), 'snapshot')} of {r.model} ({admin.mb(r.nbytes)} MB, "
        f"{sum(i.deduplicated for i in r.imported)} already present)"
        + (f"\nrefused {len(r.refused)}:\n{_problems(r.refused)}" if r.refused else "")))
    return EXIT_PROBLEMS if r.refused else EXIT_OK


def cmd_shell(ctx: Context) -> int:
    import apsw
    import apsw.shell

    path = str(admin.index_path(ctx.folder))  # refuses a folder without an index
    flags = apsw.SQLITE_OPEN_READWRITE if ctx.args.write else apsw.SQLITE_OPEN_READONLY
    conn = apsw.Connection(path, flags=flags)
    if ctx.args.json and ctx.args.sql:
        try:
            rows = _sql_rows(conn, ctx.args.sql)
        finally:
            conn.close()
        ctx.out.write(json.dumps(rows, indent=2, allow_nan=False) + "\n")
        return EXIT_OK
    try:
        shell: Any = apsw.shell.Shell(db=conn, stdout=ctx.out, stderr=ctx.err)
        shell.process_command(".header on")
        if ctx.args.json:
            shell.process_command(".mode json")
        if not ctx.args.sql:
            mode = "read-write" if ctx.args.write else "read-only"
            shell.cmdloop(intro=f"sparkcache index {path} ({mode}); views: v_models, "
                                "v_snapshots, v_segments, v_leases, v_counters; .help, .quit\n")
            return EXIT_OK
        # Errors become our one line; the shell's own report of them is dropped.
        shell.stderr = io.StringIO()
        for sql in ctx.args.sql:
            try:
                shell.process_complete_line(sql)
            except (apsw.Error, apsw.shell.Shell.Error) as exc:
                raise InvalidArgument(f"{exc} (in {sql!r})") from exc
    finally:
        conn.close()
    return EXIT_OK


def _json_value(value: Any) -> Any:
    """A column value as JSON: BLOBs in base64 (as apsw's shell writes them),
    infinities as text (JSON has no number for them)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _sql_rows(conn: Any, statements: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of every statement, in order, as one list of ``{column: value}``.

    Dot-commands print text, not rows: refused (InvalidArgument) under --json.
    """
    import apsw

    rows: list[dict[str, Any]] = []
    for sql in statements:
        if sql.lstrip().startswith("."):
            raise InvalidArgument(
                f"{sql!r} is a dot-command, which prints text, not rows: drop --json, or ask "
                "in SQL (the sqlite_master table lists the tables and views)")
        cursor = conn.cursor()
        try:
            for row in cursor.execute(sql):
                names = [column[0] for column in cursor.description]
                rows.append({n: _json_value(v) for n, v in zip(names, row, strict=True)})
        except apsw.Error as exc:
            raise InvalidArgument(f"{exc} (in {sql!r})") from exc
    return rows


def cmd_db_current(ctx: Context) -> int:
    r = admin.db_current(ctx.folder)
    ctx.emit(r, lambda: fields([("index", r.path), ("revision", r.current), ("head", r.head)])
             + ("" if r.up_to_date else "\nbehind: run `sparkcache db upgrade`"))
    return EXIT_OK if r.up_to_date else EXIT_PROBLEMS


def cmd_db_upgrade(ctx: Context) -> int:
    r = admin.db_upgrade(ctx.folder)
    ctx.emit(r, lambda: (f"upgraded {r.path} to {r.current} (applied {', '.join(r.applied)})"
                         if r.applied else f"{r.path} is at {r.current}, the newest revision"))
    return EXIT_OK


def cmd_db_downgrade(ctx: Context) -> int:
    r = admin.db_downgrade(ctx.folder, ctx.args.revision)
    ctx.emit(r, lambda: (
        f"downgraded {r.path} to {r.current} (undid {', '.join(r.undone)}); opening the "
        "store with this sparkcache would upgrade it again" if r.undone else
        f"{r.path} is at {r.current} already"))
    return EXIT_OK


# -- the parser -------------------------------------------------------------------------


def _ids(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a snapshot id (an integer)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a snapshot id (ids start at 1)")
    return value


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted before or after the subcommand (``sparkcache ls --json``).

    The subcommands' copies default to SUPPRESS, so they never overwrite a value
    given before the subcommand.
    """
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global options (before or after the command)")

    group.add_argument("--folder", metavar="DIR", default=default(None), help=FOLDER_HELP)
    group.add_argument("--storage", metavar="URL", default=default(None),
                        help="where the payloads live when not in the folder (a path or URL);"
                             " recorded when the store is created, and found again without it")
    group.add_argument("--relocate", action="store_true", default=default(False),
                        help="record --storage as the store's storage (after moving the "
                             "payloads there)")
    group.add_argument("--json", action="store_true", default=default(False),
                        help="print the result as JSON (for scripts)")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        default=default(None),
                        help="draw progress bars on stderr (default: when stderr is a terminal)")
    group.add_argument("--debug", action="store_true", default=default(False),
                        help="show the traceback of an error")


COMMANDS: list[tuple[str, Callable[[Context], int], str]] = [
    ("models", cmd_models, "list models: id, name, digest, snapshots, MB, deleted"),
    ("ls", cmd_ls, "list snapshots (of one model): tokens, MB, use, parent, pin, state"),
    ("show", cmd_show, "one snapshot with its segments, chain, children and leases"),
    ("stats", cmd_stats, "hits, misses, written/restored tokens and bytes, evictions, "
                         "quarantines"),
    ("verify", cmd_verify, "re-hash every segment file; quarantine the corrupt ones"),
    ("check", cmd_check, "compare the index with the files and processes (fsck)"),
    ("clear", cmd_clear, "delete every snapshot of a model (leased ones stay)"),
    ("rm", cmd_rm, "delete a model: its snapshots, its row and its folder"),
    ("pin", cmd_pin, "never evict a snapshot"),
    ("unpin", cmd_pin, "let a pinned snapshot be evicted again"),
    ("sweep", cmd_sweep, "run one retention pass (SPARK_KV_CACHE_* limits)"),
    ("export", cmd_export, "copy a model's snapshots, verified, to a folder or URL"),
    ("import", cmd_import, "verify and publish the snapshots of an export"),
    ("shell", cmd_shell, "interactive SQLite shell on the index (read-only by default)"),
    ("db", cmd_db_current, "the index's schema: db current, db upgrade, db downgrade"),
]
MODEL_HELP = "model id, name, or 4+ characters of its digest (see `sparkcache models`)"


class UsageError(Exception):
    """A command line argparse refused; main() reports it (as JSON under --json)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, raising UsageError instead of printing the error and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser: argparse.ArgumentParser = Parser(
        prog="sparkcache", formatter_class=fmt, epilog=EPILOG,
        description="Inspect and maintain a sparkcache KV-cache snapshot store.")
    parser.add_argument("--version", action="version", version=f"sparkcache {admin.VERSION}",
                        help="print the version and exit")
    _global_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                 title="commands")
    sub: dict[str, argparse.ArgumentParser] = {}
    for name, func, text in COMMANDS:
        p = subs.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                            parents=[common], formatter_class=fmt, epilog=EPILOG)
        p.set_defaults(func=func)
        sub[name] = p
    sub["ls"].add_argument("model", nargs="?", help=MODEL_HELP + "; default: every model")
    sub["stats"].add_argument("model", nargs="?", help=MODEL_HELP + "; default: every model")
    for name in ("show", "pin", "unpin"):
        sub[name].add_argument("id", type=_ids, help="snapshot id (see `sparkcache ls`)")
    sub["verify"].add_argument("--requeue", action="store_true",
                               help="verify the quarantined snapshots instead, and give back "
                                    "those whose files are whole again")
    sub["check"].add_argument("--fix", action="store_true",
                              help="repair what was found (remove dead rows and orphan files)")
    sub["clear"].add_argument("model", help=MODEL_HELP)
    sub["clear"].add_argument("--keep-pinned", action="store_true",
                              help="keep pinned snapshots (and their ancestors)")
    sub["clear"].add_argument("--yes", action="store_true",
                              help="do not ask for confirmation (needed without a terminal)")
    sub["rm"].add_argument("model", help=MODEL_HELP)
    for name in ("check", "clear", "rm", "sweep"):
        sub[name].add_argument(
            "--dry-run", action="store_true",
            help=("with --fix: " if name == "check" else "")
            + "print what would be deleted (--json: the same report as the real run, with "
              "dry_run, files and folders) and change nothing")
    sweep = sub["sweep"]
    sweep.add_argument("--max-age-hours", type=float, metavar="H",
                       help="override SPARK_KV_CACHE_MAX_AGE_HOURS (0 keeps while there is room)")
    sweep.add_argument("--total-mb", type=int, metavar="MB",
                       help="override SPARK_KV_CACHE_TOTAL_MB (0 = no total limit)")
    sweep.add_argument("--min-free-mb", type=int, metavar="MB",
                       help="override SPARK_KV_CACHE_MIN_FREE_MB")
    sub["export"].add_argument("model", help=MODEL_HELP)
    sub["export"].add_argument("dest", help="an empty folder, or any fsspec URL "
                                            "(memory://x, s3://bucket/path)")
    sub["import"].add_argument("src", help="a folder or URL written by `sparkcache export`")
    sub["shell"].add_argument("sql", nargs="*", help="SQL or dot-commands to run instead of "
                                                     "the interactive shell")
    sub["shell"].add_argument("--write", action="store_true",
                              help="open the index read-write (bypasses the store's "
                                   "bookkeeping; prefer the admin commands)")
    db_subs = sub["db"].add_subparsers(dest="db_command", metavar="ACTION", required=True,
                                       title="actions")
    for name, func, text in (
        ("current", cmd_db_current, "print the index's schema revision and the newest known"),
        ("upgrade", cmd_db_upgrade, "upgrade the index to the newest schema revision"),
        ("downgrade", cmd_db_downgrade, "take the index back to an older schema revision "
                                        "(for an older sparkcache)"),
    ):
        p = db_subs.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                               parents=[common], formatter_class=fmt, epilog=EPILOG)
        p.set_defaults(func=func)
        if name == "downgrade":
            p.add_argument("revision", help="the revision to go back to (see docs/index.md; "
                                            "`sparkcache db current` shows the index's)")
    return parser


def _error(err: IO[str], message: str, *, as_json: bool = False, kind: str = "Error",
           code: int = EXIT_STORE) -> int:
    """Report an error on stderr, as one line or one JSON object; returns ``code``."""
    message = " ".join(message.split())
    if as_json:
        err.write(json.dumps({"error": kind, "message": message, "exit_code": code}) + "\n")
    else:
        err.write(f"sparkcache: error: {message}\n")
    return code


def _exit_code(exc: Exception) -> int:
    if isinstance(exc, Declined):
        return EXIT_PROBLEMS
    if isinstance(exc, (InvalidArgument, NotFound)):
        return EXIT_USAGE
    return EXIT_STORE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see EXIT_CODES)."""
    out, err, inp = sys.stdout, sys.stderr, sys.stdin
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if "--json" in argv:  # not parsed, but asked for
            return _error(err, exc.message, as_json=True, kind="UsageError", code=EXIT_USAGE)
        exc.parser.print_usage(err)
        err.write(f"{exc.parser.prog}: error: {exc.message}\n")
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    ctx = Context(args, out, err, inp)
    try:
        code: int = args.func(ctx)
        out.flush()
        return code
    except KeyboardInterrupt:
        return _error(err, "interrupted", as_json=args.json, kind="KeyboardInterrupt",
                      code=EXIT_INTERRUPTED)
    except BrokenPipeError:  # `sparkcache ls | head`: the reader left, not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            import traceback

            traceback.print_exc(file=err)
        known = isinstance(exc, (SparkCacheError, OSError, Declined)) or \
            type(exc).__module__ == "apsw"
        message = str(exc) or type(exc).__name__
        if not known:
            message = (f"unexpected {type(exc).__name__}: {exc} (a sparkcache bug; rerun with "
                       "--debug and report the traceback)")
        return _error(err, message, as_json=args.json, kind=type(exc).__name__,
                      code=_exit_code(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
