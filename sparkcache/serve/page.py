"""The ``/sparkcache`` page: per model, its snapshots, hit rate, limits and requests.

Server-rendered HTML (no build step; every value escaped): the playground
(:mod:`sparkcache.serve.playground`, given as ``top``), then per model its
charts (:mod:`sparkcache.serve.charts`), the snapshots (tokens, MB, last used,
hits), the hit rate over the request log, its tenants (snapshots, MB, hit
rate, a Clear of one tenant's snapshots), the retention limits in force, the
cost model's measured rates, the latest requests with their cached and
written tokens, and a **Clear KV snapshots** button: a POST form carrying a
token only a page this server rendered has (the middleware checks it, the
request's origin and who asks: see :mod:`sparkcache.serve.middleware`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import html
from collections.abc import Iterable, Sequence

from sparkcache import admin
from sparkcache.retention import Retention
from sparkcache.serve import charts
from sparkcache.store import SnapshotStore

__all__ = ["COOKIE", "HTML", "PATH", "clear", "login_form", "render", "tenant_ref"]

PATH = "/sparkcache"
HTML = "text/html; charset=utf-8"
COOKIE = "sparkcache_admin"
#: Rows of each table the page shows at most.
SNAPSHOT_ROWS = 50
REQUEST_ROWS = 20
TENANT_ROWS = 50

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d232a;max-width:1100px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 6px}
table{border-collapse:collapse;margin:6px 0 10px}td,th{padding:3px 10px;text-align:right;
border-bottom:1px solid #e3e6ea}th{background:#f4f6f8}td.l,th.l{text-align:left}
.note{background:#eef6ee;border:1px solid #b9d8b9;padding:6px 10px;margin:10px 0}
.muted{color:#66707a}.model{border:1px solid #d5dae0;border-radius:6px;padding:4px 16px 12px;
margin:16px 0}button{background:#b3261e;color:#fff;border:0;border-radius:4px;
padding:6px 12px;cursor:pointer}dl{display:grid;grid-template-columns:max-content auto;
gap:2px 14px;margin:6px 0}dt{color:#66707a}dd{margin:0}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(head: Sequence[str], rows: Iterable[Sequence[object]], left: int = 0) -> str:
    cls = [' class="l"' if i < left else "" for i in range(len(head))]
    out = ["<table><tr>", *(f"<th{c}>{_e(h)}</th>" for c, h in zip(cls, head, strict=True)),
           "</tr>"]
    for row in rows:
        cells = (f"<td{c}>{_e(v)}</td>" for c, v in zip(cls, row, strict=True))
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _limits(store: SnapshotStore, nbytes: int) -> list[tuple[str, str]]:
    settings = admin.retention_settings(store.root)
    retention = Retention(settings)
    disk = store.backend.disk_usage()
    mb = "off" if settings.mb == -1 else (
        f"{settings.mb} MB" if settings.mb is not None else "auto")
    if disk is not None and settings.mb != -1:
        mb += f" (now {retention.model_budget_bytes(disk, nbytes) / 2**20:.0f} MB)"
    free = "auto" if settings.min_free_mb is None else f"{settings.min_free_mb} MB"
    if disk is not None:
        free += f" (now {retention.min_free_bytes(disk) / 2**20:.0f} MB; " \
                f"{disk.free / 2**20:.0f} MB free)"
    return [
        ("budget per model", mb),
        ("snapshots per model", str(settings.entries)),
        ("shortest snapshot", f"{settings.min_tokens} tokens"),
        ("unused longest", "kept while there is room" if not settings.max_age_hours
         else f"{settings.max_age_hours:g} h"),
        ("free disk kept", free),
        ("all models", "no limit beyond the disk margin" if not settings.total_mb
         else f"{settings.total_mb} MB"),
        ("per tenant", ", ".join(
            [f"{settings.tenant_mb} MB"] * bool(settings.tenant_mb)
            + [f"{settings.tenant_entries} snapshots"] * bool(settings.tenant_entries))
         or "no limit beyond the model's"),
    ]


def _model(store: SnapshotStore, model: admin.ModelRow, csrf: str) -> str:
    snapshots = admin.list_snapshots(store, model.id)
    summary = store.request_summary(model_id=model.id)
    requests = store.requests(model_id=model.id, limit=REQUEST_ROWS)
    ready = [s for s in snapshots if s.state == "ready"]
    parts = [
        f'<section class="model" id="model-{model.id}">',
        f"<h2>{_e(model.name)} <span class=\"muted\">#{model.id} "
        f"{_e(model.digest[:12])}</span></h2>",
        f"<p>{len(ready)} snapshot{'s' if len(ready) != 1 else ''}, "
        f"{sum(s.nbytes for s in snapshots) / 2**20:.1f} MB. "
        f"Hit rate over the request log: <b>{summary.hit_rate:.0%}</b> "
        f"({summary.live_tokens + summary.restored_tokens} of {summary.prompt_tokens} prompt "
        f"tokens cached: {summary.live_tokens} live, {summary.restored_tokens} restored; "
        f"{summary.written_tokens} written at breakpoints; {summary.requests} requests).</p>",
        f'<form method="post" action="{PATH}/clear">'
        f'<input type="hidden" name="model" value="{model.id}">'
        f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
        f'<button type="submit" id="clear-{model.id}">Clear KV snapshots</button></form>',
        charts.model_charts(store, model.id, sum(s.nbytes for s in snapshots)),
        "<h3>Snapshots</h3>",
    ]
    if snapshots:
        parts.append(_table(
            ["id", "state", "tokens", "MB", "last used", "hits", "parent"],
            ([s.id, s.state, s.tokens, f"{s.nbytes / 2**20:.2f}", _when(s.last_used), s.hits,
              s.parent if s.parent is not None else "-"] for s in snapshots[:SNAPSHOT_ROWS])))
    else:
        parts.append('<p class="muted">No snapshots.</p>')
    parts.append(_tenants(store, model, csrf))
    parts.append("<h3>Retention limits in force</h3><dl>")
    parts.extend(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>"
                 for k, v in _limits(store, sum(s.nbytes for s in snapshots)))
    parts.append("</dl>" + _costs(store, model))
    parts.append("<h3>Latest requests</h3>")
    if requests:
        parts.append(_table(
            ["time", "api", "prompt", "cached", "live", "restored", "written", "cache key",
             "TTFT s", "total s", "status"],
            ([_when(r.created_at), r.api or "-", _n(r.prompt_tokens), r.cached_tokens,
              _n(r.live_tokens), _n(r.restored_tokens), _n(r.written_tokens),
              r.cache_key or "", _secs(r.ttft_s), _secs(r.total_s), _n(r.status)]
             for r in requests), left=2))
    else:
        parts.append('<p class="muted">No requests yet.</p>')
    parts.append("</section>")
    return "".join(parts)


def _costs(store: SnapshotStore, model: admin.ModelRow) -> str:
    """The measured rates that decide restore or recompute (docs/connector.md)."""
    rows = store.costs(model.digest)
    if not rows:
        return ""
    return "<h3>Restore or recompute: measured rates</h3>" + _table(
        ["source", "prompt", "rate", "latency s", "samples", "updated"],
        ([r.source, f"<={1 << r.bucket}" if r.source == "prefill" else "",
          "-" if not r.unit_s else f"{1 / r.unit_s:,.0f} tokens/s" if r.source == "prefill"
          else f"{1e-6 / r.unit_s:,.1f} MB/s", f"{r.latency_s:.4f}", r.samples,
          _when(r.updated_at)] for r in rows), left=1)


def tenant_ref(tenant: str) -> str:
    """How the page's form names a tenant: a digest of its name (any name, of any
    length or characters, fits a small form)."""
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _tenants(store: SnapshotStore, model: admin.ModelRow, csrf: str) -> str:
    """The model's tenants, most requests first, each with its own Clear."""
    rows = admin.tenants(store, model.id)
    if not rows:
        return ""
    parts = ['<h3>Tenants</h3><table><tr><th class="l">tenant</th><th>snapshots</th>'
             "<th>MB</th><th>requests</th><th>hit rate</th><th></th></tr>"]
    for i, t in enumerate(rows[:TENANT_ROWS]):
        rate = f"{t.hit_rate:.0%}" if t.requests else "-"
        parts.append(
            f'<tr><td class="l">{_e(admin.printable(t.tenant))}</td><td>{t.snapshots}</td>'
            f"<td>{t.nbytes / 2**20:.2f}</td><td>{t.requests}</td><td>{rate}</td><td>"
            f'<form method="post" action="{PATH}/clear">'
            f'<input type="hidden" name="model" value="{model.id}">'
            f'<input type="hidden" name="tenant" value="{tenant_ref(t.tenant)}">'
            f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
            f'<button type="submit" id="clear-{model.id}-t{i}">Clear</button></form></td></tr>')
    parts.append("</table>")
    if len(rows) > TENANT_ROWS:
        parts.append(f'<p class="muted">{len(rows) - TENANT_ROWS} more tenants: '
                     "<code>sparkcache tenants</code> lists them all.</p>")
    return "".join(parts)


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def render(store: SnapshotStore, *, csrf: str, note: str = "", top: str = "") -> str:
    """The page, for every model of the store; ``top`` (HTML: the playground)
    goes above the models."""
    models = [m for m in admin.list_models(store) if m.deleted_at is None]
    body = [
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>sparkcache</title><style>{STYLE}{charts.STYLE}</style></head><body>",
        "<h1>sparkcache: KV snapshots</h1>",
        f'<p class="muted">Store {_e(store.root)}</p>',
    ]
    if note:
        body.append(f'<p class="note" id="note">{_e(note)}</p>')
    body.append(top)
    if not models:
        body.append("<p>No model has used this store yet.</p>")
    body.extend(_model(store, model, csrf) for model in models)
    body.append("</body></html>")
    return "".join(body)


def clear(store: SnapshotStore, model_id: int, tenant: str | None = None) -> str:
    """Clear one model's snapshots, or with ``tenant`` (a :func:`tenant_ref`) one
    tenant's (a keep lease does not stop it; a restore in flight does); returns
    what happened, for the page."""
    name = None
    if tenant is not None:
        names = [t.tenant for t in admin.tenants(store, model_id) if tenant_ref(t.tenant) == tenant]
        if not names:
            return "not cleared: no such tenant of this model"
        name = names[0]
    report = admin.clear_model(store, model_id, tenant=name)
    whose = report.model if name is None else f"tenant {admin.printable(name)} of {report.model}"
    note = f"Cleared {len(report.deleted)} snapshot{'s' if len(report.deleted) != 1 else ''} " \
           f"of {whose}"
    if report.kept_leased:
        note += f"; {len(report.kept_leased)} in use by a restore stay until it is done"
    return note


def login_form(error: str = "") -> str:
    """The admin token form (when the server has a token)."""
    message = f'<p class="note">{_e(error)}</p>' if error else ""
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>sparkcache</title><style>{STYLE}</style></head><body>"
        f"<h1>sparkcache</h1>{message}<p>This page needs the server's admin token.</p>"
        f'<form method="post" action="{PATH}/login"><input type="password" name="token" '
        'autocomplete="current-password" aria-label="admin token"> '
        '<button type="submit">Open</button></form></body></html>'
    )
