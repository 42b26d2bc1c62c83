"""The ``/sparkcache`` page's charts: inline SVG drawn on the server, no library.

Per model, from the request log (SQL sums per time bucket,
:meth:`~sparkcache.store.SnapshotStore.request_timeline`): the hit rate over
time and the prompt tokens cached (vLLM's live cache, restored from disk, from
the shared tier) against those computed; the store's size against the model's
budget and the disk against its free-space margin; and the time to first token
of requests that found tokens cached against those that found none.  Every
chart is an ``<svg role="img">`` with a ``<title>`` and a ``<desc>`` that says
what it shows in words, and a caption under it that says the same briefly.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Callable, Sequence

from sparkcache import admin
from sparkcache.requestlog import Timeline, Ttfts
from sparkcache.retention import Retention
from sparkcache.store import SnapshotStore

__all__ = ["STYLE", "gauges", "hit_rate", "model_charts", "tokens", "ttft"]

#: The charts' colours: cached tokens by where they came from, computed ones, lines.
LIVE, DISK, TIER, COMPUTED, LINE, LIMIT = \
    "#1b7a3a", "#5cb270", "#1f8a9e", "#c4ccd4", "#1e5fb4", "#b3261e"
W, H = 480, 190  # one chart's size; the plot area leaves room for the axes' labels
LEFT, RIGHT, TOP, BOTTOM = 54, 12, 14, 40
STYLE = """
.charts{display:flex;flex-wrap:wrap;gap:8px 18px;margin:8px 0}
.charts figure{margin:0;width:480px}.charts figcaption{color:#4a545e;font-size:13px}
.charts svg{display:block;background:#fbfcfd;border:1px solid #e3e6ea;border-radius:4px}
.charts text{font:11px system-ui,sans-serif;fill:#4a545e}.charts .t{font-size:12px;fill:#1d232a}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _figure(ident: str, title: str, desc: str, body: str, caption: str,
            height: int = H) -> str:
    """One chart: the SVG (role img, titled and described) and its caption."""
    return (f'<figure><svg role="img" id="{ident}" aria-labelledby="{ident}-t {ident}-d" '
            f'width="{W}" height="{height}" viewBox="0 0 {W} {height}">'
            f'<title id="{ident}-t">{_e(title)}</title><desc id="{ident}-d">{_e(desc)}</desc>'
            f'<text class="t" x="{LEFT}" y="11">{_e(title)}</text>{body}</svg>'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _count(n: float) -> str:
    """A token count short: 950, 12.3k, 4.1M."""
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


def _clock(ts: float, width: float) -> str:
    fmt = "%H:%M:%S" if width < 60 else "%H:%M" if width < 86400 else "%m-%d"
    return dt.datetime.fromtimestamp(ts).strftime(fmt)


def _span(width: float) -> str:
    if width < 60:
        return f"{width:g} s"
    return f"{width / 86400:g} d" if width >= 86400 else (
        f"{width / 3600:g} h" if width >= 3600 else f"{width / 60:g} min")


def _x_axis(line: Timeline) -> str:
    """The time axis: the first bucket's start, the middle and the end."""
    plot_w, base = W - LEFT - RIGHT, H - BOTTOM
    out = [f'<line x1="{LEFT}" y1="{base}" x2="{W - RIGHT}" y2="{base}" stroke="#9aa4ae"/>']
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        ts = line.start + frac * line.count * line.width
        out.append(f'<text x="{LEFT + frac * plot_w:.1f}" y="{base + 14}" '
                   f'text-anchor="{anchor}">{_clock(ts, line.width)}</text>')
    out.append(f'<text x="{W - RIGHT}" y="{base + 28}" text-anchor="end">'
               f"one bar or point per {_span(line.width)}</text>")
    return "".join(out)


def _y_grid(top_value: float, label: Callable[[float], str]) -> str:
    """Horizontal grid lines at 0, half and the top, labelled by ``label(value)``."""
    plot_h, base = H - TOP - BOTTOM - 8, H - BOTTOM
    out = []
    for frac in (0.0, 0.5, 1.0):
        y = base - frac * plot_h
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" '
                   f'stroke="#e3e6ea"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                   f'text-anchor="end">{label(frac * top_value)}</text>')
    return "".join(out)


def hit_rate(ident: str, line: Timeline) -> str:
    """The share of prompt tokens cached, per bucket, as a line over time."""
    plot_w, plot_h, base = W - LEFT - RIGHT, H - TOP - BOTTOM - 8, H - BOTTOM
    step = plot_w / line.count
    points = [(LEFT + (b.index + 0.5) * step, base - b.hit_rate * plot_h, b)
              for b in line.buckets]
    body = [_y_grid(1.0, lambda v: f"{v:.0%}"), _x_axis(line)]
    if len(points) > 1:
        body.append(f'<polyline fill="none" stroke="{LINE}" stroke-width="2" points="'
                    + " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points) + '"/>')
    body.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{LINE}"><title>'
                f"{_clock(line.start + b.index * line.width, line.width)}: {b.hit_rate:.0%} "
                f"of {b.prompt_tokens} prompt tokens, {b.requests} requests</title></circle>"
                for x, y, b in points)
    total = sum(b.prompt_tokens for b in line.buckets)
    cached = sum(b.cached_tokens for b in line.buckets)
    rate = cached / total if total else 0.0
    last = line.buckets[-1]
    rates = [b.hit_rate for b in line.buckets]
    desc = (f"Hit rate per {_span(line.width)} over {line.count} periods: {rate:.0%} overall, "
            f"{last.hit_rate:.0%} in the latest, lowest {min(rates):.0%}, "
            f"highest {max(rates):.0%}.")
    return _figure(ident, "Hit rate (share of prompt tokens cached)", desc, "".join(body),
                   f"{rate:.0%} of {total} prompt tokens were cached; latest "
                   f"{_span(line.width)}: {last.hit_rate:.0%}.")


def tokens(ident: str, line: Timeline) -> str:
    """Prompt tokens per bucket as stacked bars: live, disk, tier, computed."""
    plot_w, plot_h, base = W - LEFT - RIGHT, H - TOP - BOTTOM - 8, H - BOTTOM
    step = plot_w / line.count
    top = max((b.prompt_tokens for b in line.buckets), default=0) or 1
    body = [_y_grid(top, _count), _x_axis(line)]
    sums = {"live": 0, "disk": 0, "tier": 0, "computed": 0}
    for b in line.buckets:
        parts = (("live", b.live_tokens, LIVE), ("disk", b.restored_tokens - b.remote_tokens,
                                                 DISK),
                 ("tier", b.remote_tokens, TIER),
                 ("computed", max(0, b.prompt_tokens - b.cached_tokens), COMPUTED))
        y, bar = float(base), min(step * 0.76, 36.0)
        x = LEFT + (b.index + 0.5) * step - bar / 2
        for name, n, colour in parts:
            sums[name] += n
            if n <= 0:
                continue
            h = n / top * plot_h
            y -= h
            body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                        f'height="{h:.1f}" fill="{colour}"><title>{name}: {n} tokens'
                        f"</title></rect>")
    body.append(_legend([("live", LIVE), ("disk", DISK), ("shared tier", TIER),
                         ("computed", COMPUTED)]))
    total = sum(sums.values())
    desc = (f"Prompt tokens per {_span(line.width)}, stacked: {sums['live']} cached live in "
            f"vLLM, {sums['disk']} restored from disk, {sums['tier']} from the shared tier, "
            f"{sums['computed']} computed, of {total} in all.")
    cached = sums["live"] + sums["disk"] + sums["tier"]
    return _figure(ident, "Prompt tokens: cached and computed", desc, "".join(body),
                   f"{_count(cached)} cached ({_count(sums['live'])} live, "
                   f"{_count(sums['disk'])} disk, {_count(sums['tier'])} tier), "
                   f"{_count(sums['computed'])} computed.")


def _legend(items: Sequence[tuple[str, str]]) -> str:
    out, x = [], float(LEFT)
    for name, colour in items:
        out.append(f'<rect x="{x:.0f}" y="{H - 12}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14:.0f}" y="{H - 3}">{_e(name)}</text>')
        x += 24 + 6.5 * len(name)
    return "".join(out)


def _bar(y: float, label: str, parts: Sequence[tuple[float, str, str]], scale: float,
         marks: Sequence[tuple[float, str]] = ()) -> str:
    """One horizontal bar of ``parts`` (value, colour, tooltip) with limit marks."""
    x, plot_w = float(LEFT + 70), W - LEFT - 70 - RIGHT
    out = [f'<text x="{LEFT + 64}" y="{y + 13}" text-anchor="end">{_e(label)}</text>',
           f'<rect x="{x}" y="{y}" width="{plot_w}" height="18" fill="#eef1f4"/>']
    for value, colour, tip in parts:
        w = max(0.0, min(value / scale, 1.0)) * plot_w
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="18" fill="{colour}">'
                   f"<title>{_e(tip)}</title></rect>")
        x += w
    for value, tip in marks:
        mx = LEFT + 70 + max(0.0, min(value / scale, 1.0)) * plot_w
        out.append(f'<line x1="{mx:.1f}" y1="{y - 4}" x2="{mx:.1f}" y2="{y + 22}" '
                   f'stroke="{LIMIT}" stroke-width="2"><title>{_e(tip)}</title></line>')
    return "".join(out)


def _mb(n: float) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def gauges(ident: str, nbytes: int, budget: int | None, total: int | None, free: int | None,
           margin: int | None) -> str:
    """This model's snapshots against its budget; the disk against its margin."""
    height = 130
    body = []
    sentences = []
    if budget is not None:
        scale = max(budget, nbytes, 1)
        body.append(_bar(30, "model", [(nbytes, LIVE, f"snapshots: {_mb(nbytes)}")], scale,
                         [(budget, f"budget: {_mb(budget)}")]))
        body.append(f'<text x="{LEFT + 70}" y="64">{_mb(nbytes)} of {_mb(budget)} budget '
                    f"({nbytes / budget if budget else 0:.0%})</text>")
        sentences.append(f"The model's snapshots take {_mb(nbytes)} of a {_mb(budget)} "
                         f"budget ({nbytes / budget if budget else 0:.0%}).")
    else:
        sentences.append(f"The model's snapshots take {_mb(nbytes)}; it has no budget (off).")
    if total and free is not None and margin is not None:
        used = total - free
        body.append(_bar(80, "disk", [(used, "#7d8a96", f"used: {_mb(used)}")], total,
                         [(total - margin, f"kept free: {_mb(margin)}")]))
        body.append(f'<text x="{LEFT + 70}" y="114">{_mb(free)} free of {_mb(total)}; '
                    f"snapshots go when under {_mb(margin)}</text>")
        sentences.append(f"The disk has {_mb(free)} free of {_mb(total)}; below {_mb(margin)} "
                         "free, snapshots are evicted and none saved.")
    text = " ".join(sentences)
    return _figure(ident, "Store size against budget and disk margin", text, "".join(body),
                   text, height)


def _pct(values: Sequence[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))]


def ttft(ident: str, times: Ttfts) -> str:
    """Time to first token, hits against misses: median bar, 90th percentile whisker."""
    height = 130
    groups = [("hits", times.hits, LIVE), ("misses", times.misses, COMPUTED)]
    scale = max((_pct(v, 0.9) for _, v, _ in groups if v), default=1.0) or 1.0
    body, sentences = [], []
    for i, (name, values, colour) in enumerate(groups):
        y = 30 + i * 44
        if not values:
            body.append(f'<text x="{LEFT + 64}" y="{y + 13}" text-anchor="end">{name}</text>'
                        f'<text x="{LEFT + 70}" y="{y + 13}">no requests yet</text>')
            sentences.append(f"No {name} yet.")
            continue
        p50, p90 = _pct(values, 0.5), _pct(values, 0.9)
        body.append(_bar(y, name, [(p50, colour, f"median {p50 * 1000:.0f} ms")], scale,
                         [(p90, f"90th percentile {p90 * 1000:.0f} ms")]))
        body.append(f'<text x="{LEFT + 70}" y="{y + 32}">median {p50 * 1000:.0f} ms, '
                    f"p90 {p90 * 1000:.0f} ms, {len(values)} requests</text>")
        sentences.append(f"{name.capitalize()}: median {p50 * 1000:.0f} ms, 90th percentile "
                         f"{p90 * 1000:.0f} ms over {len(values)} requests.")
    text = " ".join(sentences)
    return _figure(ident, "Time to first token: hits and misses", text, "".join(body), text,
                   height)


def model_charts(store: SnapshotStore, model_id: int, nbytes: int) -> str:
    """The charts of one model's section of the page."""
    line = store.request_timeline(model_id)
    settings = admin.retention_settings(store.root)
    retention = Retention(settings)
    disk = store.backend.disk_usage()
    budget = None if settings.mb == -1 else retention.model_budget_bytes(disk, nbytes)
    parts = ['<h3>Charts</h3><div class="charts">']
    if line is not None:
        parts += [hit_rate(f"chart-hits-{model_id}", line),
                  tokens(f"chart-tokens-{model_id}", line)]
    else:
        parts.append('<p class="muted">No requests yet: the charts over time start with '
                     "the first.</p>")
    parts.append(gauges(f"chart-store-{model_id}", nbytes, budget,
                        disk.total if disk else None, disk.free if disk else None,
                        retention.min_free_bytes(disk) if disk else None))
    parts.append(ttft(f"chart-ttft-{model_id}", store.request_ttfts(model_id)))
    parts.append("</div>")
    return "".join(parts)
