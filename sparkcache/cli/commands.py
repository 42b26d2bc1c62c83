"""The ``sparkcache`` subcommands that read a store (models, ls, show, stats,
log), run the server, and the SQL ones (shell, db); the ones that change or
check a store are in :mod:`sparkcache.cli.maintenance`.  Each calls one
:mod:`sparkcache.admin` function.

``cmd_<name>(ctx)`` reads its arguments from ``ctx.args``, opens the store
through the :class:`~sparkcache.cli.output.Context` (without upgrading its
schema for read-only commands and dry runs), calls admin, prints the result
with ``ctx.emit`` and returns the exit status.  Errors are raised, never
printed: :func:`sparkcache.cli.main` reports them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from sparkcache import admin
from sparkcache.cli.output import (
    EXIT_OK,
    EXIT_PROBLEMS,
    Context,
    fields,
    table,
    when,
)
from sparkcache.errors import InvalidArgument
from sparkcache.serve import launch

__all__ = [
    "cmd_db_current", "cmd_db_downgrade", "cmd_db_upgrade", "cmd_log", "cmd_ls",
    "cmd_models", "cmd_serve", "cmd_shell", "cmd_show", "cmd_stats", "cmd_tenants",
]

#: How often ``log --follow`` looks for new requests, in seconds.
FOLLOW_INTERVAL = 0.5
#: Rows ``log --follow`` reads at a time; it reads again at once after a full batch.
FOLLOW_BATCH = 500
LOG_HEADERS = ("TIME", "MODEL", "API", "PROMPT", "CACHED", "LIVE+RESTORED", "WRITTEN",
               "BREAKPOINTS", "CACHE KEY", "TTFT", "TOTAL")
#: The least widths and the alignment of the log's columns: the rows ``--follow``
#: prints later line up with the first ones (columns only ever widen).
LOG_WIDTHS = (19, 16, 11, 6, 6, 13, 7, 11, 9, 6, 7)
LOG_RIGHT = (False, False, False, True, True, True, True, False, False, True, True)


def cmd_serve(ctx: Context) -> int:
    """``sparkcache [--folder DIR] serve ...``: becomes vLLM's server (the launcher
    parses the rest; a global ``--folder`` is passed on unless ``serve`` has its own)."""
    argv = list(ctx.args.serve_args)
    if ctx.args.folder and "--folder" not in argv:
        argv = ["--folder", str(ctx.args.folder), *argv]
    return launch.main(argv)


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
        ["ID", "MODEL", "TOKENS", "MB", "SHARDING", "TENANT", "CREATED", "LAST USED", "HITS",
         "PARENT", "PINNED", "STATE", "UPLOADED", "REASON"],
        [[r.id, r.model, r.tokens, r.mb, r.sharding, r.tenant, when(r.created_at),
          when(r.last_used), r.hits, r.parent, "yes" if r.pinned else "", r.state,
          when(r.uploaded_at), r.reason]
         for r in rows],
    )


def _cost_table(rows: Sequence[admin.CostRow]) -> str:
    """The cost model's rates for people: tokens/s for prefill, MB/s for a restore."""
    def rate(r: admin.CostRow) -> str:
        if not r.unit_s:
            return "-"
        if r.source == "prefill":
            return f"{1 / r.unit_s:,.0f} tokens/s"
        return f"{1e-6 / r.unit_s:,.1f} MB/s"

    return table(
        ["SOURCE", "MODEL", "PROMPT", "RATE", "LATENCY S", "SAMPLES", "UPDATED"],
        [[r.source, r.model[:12] or "(host)", f"<={1 << r.bucket}" if r.source == "prefill"
          else "", rate(r), round(r.latency_s, 4), r.samples, when(r.updated_at)]
         for r in rows],
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
            ("size", f"{s.mb} MB ({s.nbytes} bytes)"), ("ranks", f"{s.world_size} ({s.sharding})"),
            ("tenant", s.tenant or "none"),
            ("parent", s.parent), ("depth", s.depth), ("pinned", "yes" if s.pinned else "no"),
            ("hits", s.hits), ("created", when(s.created_at)), ("last used", when(s.last_used)),
            ("uploaded", when(s.uploaded_at) if s.uploaded_at else "no"),
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
        c = st.counters
        if any(name.startswith("upload") for name in c):
            pairs.append(("uploaded", f"{c.get('uploads', 0)} snapshots, "
                                      f"{admin.mb(c.get('upload_bytes', 0))} MB; "
                                      f"{c.get('uploads.present', 0)} found in the tier; "
                                      f"{c.get('upload_failures', 0)} failures"))
        if any(name.startswith("fetch") for name in c):
            pairs.append(("fetched", f"{c.get('fetches', 0)} snapshots, "
                                     f"{admin.mb(c.get('fetch_bytes', 0))} MB from the tier; "
                                     f"{c.get('fetch_misses', 0)} misses; "
                                     f"{c.get('fetch_refused', 0)} refused"))
        body = fields(pairs)
        if st.costs:
            body += "\n\nmeasured costs (restore or recompute):\n" + _cost_table(st.costs)
        if st.quarantined:
            body += "\n\nquarantined now:\n" + _snapshot_table(st.quarantined)
        return body

    ctx.emit(st, text)
    return EXIT_OK


class _LogTable:
    """The request log as text: a table whose header is printed once, and whose
    rows name a model as the request did, else by its model row's name."""

    def __init__(self, ctx: Context, store: admin.SnapshotStore) -> None:
        self.ctx, self.store = ctx, store
        self.names: dict[int, str] = {}
        self.header = True
        self.widths = list(LOG_WIDTHS)

    def model(self, row: admin.RequestRow) -> str | None:
        if row.model is not None or row.model_id is None:
            return row.model
        if row.model_id not in self.names:  # a model new since the last look
            self.names = {m.id: m.name for m in admin.list_models(self.store)}
        return self.names.get(row.model_id, f"#{row.model_id}")

    def print(self, rows: Sequence[admin.RequestRow]) -> None:
        if self.ctx.args.json:
            self.ctx.emit_lines(rows)
            return
        if not rows:
            return
        # A client's text is printed escaped: it can never forge a line of the table.
        cells = [[when(r.created_at), admin.printable(self.model(r)), r.api, r.prompt_tokens,
                  r.cached_tokens, f"{r.live_tokens or 0}+{r.restored_tokens or 0}",
                  r.written_tokens, ",".join(map(str, r.breakpoints)) or None,
                  admin.printable(r.cache_key), _seconds(r.ttft_s),
                  _seconds(r.total_s)] for r in rows]
        self.widths = [max(width, *(len("-" if c is None else str(c)) for c in column))
                       for width, column in zip(self.widths, zip(*cells, strict=True),
                                                strict=True)]
        self.ctx.out.write(table(LOG_HEADERS, cells, widths=self.widths, right=LOG_RIGHT,
                                 header=self.header) + "\n")
        self.ctx.out.flush()
        self.header = False


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def cmd_tenants(ctx: Context) -> int:
    """Each tenant of each model: snapshots, MB, requests and hit rate; a tenant's
    name printed with control and format characters escaped, as every table is."""
    with ctx.store(upgrade=False) as store:
        rows = admin.tenants(store, ctx.args.model)

    def text() -> str:
        if not rows:
            return "no tenants"
        return table(("MODEL", "TENANT", "SNAPSHOTS", "MB", "REQUESTS", "HIT RATE"),
                     [[r.model, r.tenant, r.snapshots, r.mb, r.requests,
                       f"{r.hit_rate:.1%}" if r.requests else "-"] for r in rows])

    ctx.emit(rows, text)
    return EXIT_OK


def cmd_log(ctx: Context) -> int:
    a = ctx.args
    with ctx.store(upgrade=False) as store:
        out = _LogTable(ctx, store)
        rows = admin.request_log(store, model=a.model, limit=a.limit)[::-1]  # oldest first
        out.print(rows)
        if not a.follow:
            if not rows and not a.json:
                ctx.out.write("no requests logged\n")
            return EXIT_OK
        last = rows[-1].seq if rows else 0
        try:
            with _stopped_by_sigterm():
                _follow(ctx, store, out, last)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: how a follow ends
            return EXIT_OK
    return EXIT_OK


class _Stop(KeyboardInterrupt):
    """SIGTERM during ``log --follow``: ends it as Ctrl-C does."""


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`_Stop` inside the block (main thread only).

    SIGINT needs no handler: Python raises KeyboardInterrupt for it, unless
    the process started with SIGINT ignored (a background job of a
    non-interactive shell inherits that), which is then kept, as every
    program keeps it; SIGTERM still ends the follow with status 0."""
    def stop(signum: int, frame: object) -> None:
        raise _Stop

    if threading.current_thread() is not threading.main_thread():
        yield  # (signals reach the main thread only)
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _follow(ctx: Context, store: admin.SnapshotStore, out: _LogTable, last: int) -> None:
    """Print the requests logged after ``last``, every FOLLOW_INTERVAL, forever."""
    a = ctx.args
    while True:
        time.sleep(FOLLOW_INTERVAL)
        while True:
            rows = admin.request_log(store, model=a.model, limit=FOLLOW_BATCH, after=last)
            out.print(rows)
            last = rows[-1].seq if rows else last
            if len(rows) < FOLLOW_BATCH:
                break


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
                                "v_snapshots, v_segments, v_leases, v_counters, "
                                "v_request_log, v_costs; .help, .quit\n")
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
