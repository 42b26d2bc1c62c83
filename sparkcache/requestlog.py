"""The request log: what each request found cached, what it wrote and what it cost.

One row per request in the index's ``request_log`` table (revision 0005; every
column in docs/index.md), visible at the ``sqlite3`` shell (``v_request_log``),
in ``sparkcache log`` and in ``sparkcache serve``'s reports.  :func:`record`
writes a batch of rows in one transaction: a row names its request
(``request_id``) and gives what is known so far, and a later row of the same
request fills in the rest (the connector records a request when its prompt is
scheduled and again when it finished).  The log keeps the newest rows only
(``keep``, from ``SPARK_KV_CACHE_LOG_ROWS``: :func:`log_rows_setting`), so it
never grows with the life of the store.  Every function takes the narrow
:class:`~sparkcache.core.Core`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from sparkcache.core import Conn, Core, select_all, select_one
from sparkcache.errors import InvalidArgument
from sparkcache.index import queries as q
from sparkcache.index.schema import REQUEST_APIS

__all__ = [
    "DEFAULT_LOG_ROWS",
    "LOG_FIELDS",
    "LOG_ROWS_VARIABLE",
    "MAX_TEXT",
    "Bucket",
    "KeySummary",
    "LogSummary",
    "RequestRow",
    "Timeline",
    "Ttfts",
    "by_answer",
    "by_cache_key",
    "log_rows_setting",
    "printable",
    "record",
    "request",
    "requests",
    "summary",
    "timeline",
    "ttfts",
]

#: Rows the log keeps unless ``SPARK_KV_CACHE_LOG_ROWS`` says otherwise.
DEFAULT_LOG_ROWS: Final = 10_000
LOG_ROWS_VARIABLE: Final = "SPARK_KV_CACHE_LOG_ROWS"
#: The columns a row given to :func:`record` may name: every one but ``seq``.
LOG_FIELDS: Final[tuple[str, ...]] = tuple(q.REQUEST_FIELDS.split(", "))

# What each field holds (request_id, model, api, cache_key, tenant are text).
_COUNTS: Final = frozenset({"model_id", "prompt_tokens", "live_tokens", "restored_tokens",
                            "written_tokens", "output_tokens", "status", "remote_tokens"})
_TIMES: Final = frozenset({"created_at", "queue_s", "restore_s", "ttft_s", "total_s"})
#: The longest model name, prompt_cache_key or tenant stored (longer ones are cut, marked
#: with a trailing "..."); a request id longer than MAX_ID is refused.
MAX_TEXT: Final = 1024
MAX_ID: Final = 256
#: The longest fingerprint stored (JSON of digests, sparkcache.serve.diagnostics).
MAX_FINGERPRINT: Final = 64 * 1024
_CUT: Final = "..."


# -- rows ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRow:
    """One ``request_log`` row (``queries.REQUEST_COLUMNS``); None: never recorded."""

    seq: int  # the order rows were first recorded
    request_id: str
    created_at: float  # unix seconds the request arrived
    model_id: int | None  # models.id of the engine's model (that row may be gone)
    model: str | None  # as the API request named it
    api: str | None  # 'messages', 'chat', 'completions', 'responses'; None: not the server
    cache_key: str | None  # the OpenAI prompt_cache_key
    prompt_tokens: int | None
    live_tokens: int | None  # served by vLLM's own prefix cache
    restored_tokens: int | None  # restored from snapshots
    written_tokens: int | None  # newly written as snapshots at its breakpoints
    output_tokens: int | None
    breakpoints: tuple[int, ...]  # token positions; () when none were recorded
    queue_s: float | None
    restore_s: float | None
    ttft_s: float | None
    total_s: float | None
    status: int | None  # the HTTP status answered
    remote_tokens: int | None = None  # of restored_tokens, from the shared tier
    #: written_tokens by their breakpoints' keep time, whole seconds as text
    #: ("300", "3600"; "0": a breakpoint without one); None: not recorded.
    written_by_ttl: dict[str, int] | None = None
    tenant: str | None = None  # the request's tenant (docs/serve.md, "Tenants")
    answer_id: str | None = None  # the id the client saw on the answer (diagnostics)
    fingerprint: str | None = None  # the prompt's parts' digests, JSON (diagnostics)
    #: The cost model's decision: 'restored', 'partial', 'too_slow' (None: none made).
    restore_reason: str | None = None

    def __post_init__(self) -> None:
        # The index holds the JSON text (or NULL).
        if not isinstance(self.breakpoints, tuple):
            object.__setattr__(self, "breakpoints", _read_breakpoints(self.breakpoints))
        if self.written_by_ttl is not None and not isinstance(self.written_by_ttl, dict):
            object.__setattr__(self, "written_by_ttl", _by_ttl(self.written_by_ttl))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed: vLLM's own hit plus the restored ones."""
        return (self.live_tokens or 0) + (self.restored_tokens or 0)


class _Cached:
    """What sums of requests' tokens say of the cache: the tokens not computed."""

    prompt_tokens: int
    live_tokens: int
    restored_tokens: int

    @property
    def cached_tokens(self) -> int:
        return self.live_tokens + self.restored_tokens

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens not computed; 0.0 with no prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class LogSummary(_Cached):
    """Sums over the rows the log holds (of one model, or of all)."""

    requests: int
    prompt_tokens: int
    live_tokens: int
    restored_tokens: int
    written_tokens: int


@dataclass(frozen=True)
class KeySummary:
    """The requests of one ``prompt_cache_key`` in the log."""

    cache_key: str
    requests: int
    prompt_tokens: int
    cached_tokens: int  # live + restored

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _read_breakpoints(stored: object) -> tuple[int, ...]:
    """Breakpoints as stored (JSON text, NULL) or given as a list.  A row written
    by hand that is not a JSON list of integers reads as none: the log is for
    looking at, and one bad row must not hide the others."""
    if isinstance(stored, str):
        try:
            stored = json.loads(stored)
        except ValueError:
            return ()
    if isinstance(stored, list) and all(isinstance(n, int) for n in stored):
        return tuple(stored)
    return ()


def _by_ttl(value: object) -> dict[str, int] | None:
    """``value`` (a mapping, or it as JSON text) as a ``written_by_ttl``: keys whole
    seconds as text, values whole token counts; None when it is not one (a row
    written by hand reads as None, as :func:`_read_breakpoints` reads it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12 and _whole(v)
            for k, v in value.items()):
        return None
    return {k: int(v) for k, v in value.items()}


# -- writing ------------------------------------------------------------------------


def _shown(value: object) -> str:
    """``repr(value)``, at most 80 characters (an error never repeats a whole input)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + _CUT


def _bad(name: str, value: object, what: str) -> InvalidArgument:
    return InvalidArgument(f"request log field {name}={_shown(value)} must be {what}")


def _text(value: str) -> str:
    """``value`` as the index stores client text: valid UTF-8 (a lone surrogate
    written as ``\\udXXX``), at most :data:`MAX_TEXT` characters."""
    if len(value) > MAX_TEXT:
        value = value[:MAX_TEXT - len(_CUT)] + _CUT
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def printable(text: str | None) -> str | None:
    """``text`` safe to print on a terminal: control and format characters
    (escape sequences, newlines, bidirectional overrides) written as ``\\xNN``
    / ``\\uNNNN`` escapes, so that a row can never forge another line."""
    if text is None:
        return None
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _whole(value: object) -> bool:
    """A whole number >= 0 (numpy's integers too; never a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _json_field(name: str, value: Any) -> str:
    """``breakpoints`` or ``written_by_ttl`` (given as it is, or as JSON text) as
    the JSON text the index stores; InvalidArgument if it is not one."""
    if name == "written_by_ttl":
        by_ttl = _by_ttl(value)
        if by_ttl is None:
            raise _bad(name, value, 'a mapping of keep seconds as text to token counts '
                       '({"300": 64})')
        return json.dumps(by_ttl, separators=(",", ":"), sort_keys=True)
    points = value
    if isinstance(value, str):  # given as JSON already
        try:
            points = json.loads(value)
        except ValueError:
            points = None
    if not isinstance(points, (list, tuple)) or not all(_whole(n) for n in points):
        raise _bad(name, value, "a list of token positions (whole numbers >= 0)")
    return json.dumps([int(n) for n in points], separators=(",", ":"))


def _fingerprint(value: Any) -> str:
    """A fingerprint as stored: digests only, made by the server, never cut."""
    if not isinstance(value, str) or len(value) > MAX_FINGERPRINT:
        raise _bad("fingerprint", value, f"a string of at most {MAX_FINGERPRINT} characters")
    return value


def _field(name: str, value: Any) -> Any:
    """``value`` as the index stores field ``name``; InvalidArgument if it cannot."""
    if value is None:
        return None
    if name in _COUNTS:
        if not _whole(value):
            raise _bad(name, value, "a whole number >= 0")
        return int(value)
    if name in _TIMES:
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(value) or value < 0):
            raise _bad(name, value, "a number of seconds >= 0")
        return float(value)
    if name in ("breakpoints", "written_by_ttl"):
        return _json_field(name, value)
    if name == "fingerprint":
        return _fingerprint(value)
    if name in ("model", "cache_key", "tenant"):  # a client's text, as it sent it (even empty)
        if not isinstance(value, str):
            raise _bad(name, value, "a string")
        return _text(value)
    if not isinstance(value, str) or not value or (name in ("request_id", "answer_id")
                                                   and len(value) > MAX_ID):
        raise _bad(name, value, "a non-empty string" + (
            f" of at most {MAX_ID} characters" if name in ("request_id", "answer_id") else ""))
    if name == "api" and value not in REQUEST_APIS:
        raise _bad(name, value, f"one of {', '.join(REQUEST_APIS)} (None: not the server)")
    return _text(value)


def _params(row: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The named parameters of UPDATE_REQUEST and INSERT_REQUEST for one row."""
    if not isinstance(row, Mapping):
        raise InvalidArgument(f"a request log row is a mapping of fields, got {_shown(row)}")
    unknown = [key for key in row if key not in LOG_FIELDS]
    if unknown:
        raise InvalidArgument(
            f"unknown request log field(s) {', '.join(map(_shown, unknown[:5]))}: a row names "
            f"{', '.join(LOG_FIELDS)}")
    params = {name: _field(name, row.get(name)) for name in LOG_FIELDS}
    if params["request_id"] is None:
        raise InvalidArgument(f"a request log row needs its request_id: {_shown(dict(row))}")
    params["now"] = now
    return params


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def record(core: Core, rows: Sequence[Mapping[str, Any]], *, keep: int) -> None:
    """Record ``rows`` (each a mapping of :data:`LOG_FIELDS`), then keep only the
    newest ``keep`` (>= 1) rows of the log, all in one write transaction.

    A row names its request (``request_id``, required) and fills in its row: a
    field it gives (not None) is written, the others keep what an earlier record
    of the request stored.  A request recorded for the first time without
    ``created_at`` arrived now (the core's clock).  ``breakpoints`` is a list of
    token positions (or that list as JSON text), stored as JSON.  An unknown
    field, or a value its column cannot hold, raises InvalidArgument and nothing
    of the batch is written.  A model name or cache key is stored as valid UTF-8
    and cut to :data:`MAX_TEXT` characters (print it through :func:`printable`).
    Trimming is one range delete on the primary key: the log costs the same
    whatever it held before.
    """
    _check_count("keep", keep, 1)
    now = core.clock()
    params = [_params(row, now) for row in rows]
    with core.write() as conn:
        for one in params:
            conn.execute(q.UPDATE_REQUEST, one)
            if conn.changes() == 0:
                conn.execute(q.INSERT_REQUEST, one)
        conn.execute(q.TRIM_REQUEST_LOG, (keep,))


# -- reading ------------------------------------------------------------------------


def requests(core: Core, *, model_id: int | None = None, limit: int = 50,
             after_seq: int | None = None) -> list[RequestRow]:
    """At most ``limit`` rows (of one model, when given): the newest first, or,
    with ``after_seq``, the rows recorded after that one, oldest first (to
    follow the log: pass the last ``seq`` seen)."""
    _check_count("limit", limit, 1)
    with core.read() as conn:
        if after_seq is None:
            if model_id is None:
                return select_all(conn, q.REQUESTS_NEWEST, (limit,), into=RequestRow)
            return select_all(conn, q.REQUESTS_NEWEST_OF_MODEL, (model_id, limit), into=RequestRow)
        _check_count("after_seq", after_seq, 0)
        if model_id is None:
            return select_all(conn, q.REQUESTS_AFTER, (after_seq, limit), into=RequestRow)
        return select_all(conn, q.REQUESTS_AFTER_OF_MODEL, (model_id, after_seq, limit),
                     into=RequestRow)


def request(core: Core, request_id: str) -> RequestRow | None:
    """The row of one request, or None (never recorded, or trimmed since)."""
    with core.read() as conn:
        return select_one(conn, q.REQUEST_BY_ID, (request_id,), into=RequestRow)


def by_answer(core: Core, answer_id: str) -> RequestRow | None:
    """The newest row whose answer the client saw as ``answer_id``, or None
    (never recorded, or trimmed since)."""
    with core.read() as conn:
        return select_one(conn, q.REQUEST_BY_ANSWER, (answer_id,), into=RequestRow)


def _sums(conn: Conn, model_id: int | None) -> LogSummary:
    if model_id is None:
        found = select_one(conn, q.REQUEST_SUMMARY, into=LogSummary)
    else:
        found = select_one(conn, q.REQUEST_SUMMARY_OF_MODEL, (model_id,), into=LogSummary)
    return found or LogSummary(0, 0, 0, 0, 0)


def summary(core: Core, *, model_id: int | None = None) -> LogSummary:
    """Requests and token sums over the log (of one model, when given)."""
    with core.read() as conn:
        return _sums(conn, model_id)


def by_cache_key(core: Core, *, model_id: int | None = None) -> list[KeySummary]:
    """One summary per ``prompt_cache_key`` (requests without one left out), most
    requests first."""
    with core.read() as conn:
        if model_id is None:
            return select_all(conn, q.REQUESTS_BY_KEY, into=KeySummary)
        return select_all(conn, q.REQUESTS_BY_KEY_OF_MODEL, (model_id,), into=KeySummary)


@dataclass(frozen=True)
class Bucket(_Cached):
    """One time bucket of :func:`timeline`: the requests in it and their token sums."""

    index: int  # whole bucket widths after the timeline's start
    requests: int
    prompt_tokens: int
    live_tokens: int
    restored_tokens: int  # from snapshots, the shared tier's included
    remote_tokens: int  # of restored_tokens, from the shared tier


@dataclass(frozen=True)
class Timeline:
    """A model's counted requests over time: ``buckets`` (only those with
    requests) of ``width`` seconds from ``start``, ``count`` buckets in all."""

    start: float
    width: float
    count: int
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class Ttfts:
    """A model's first-token times in seconds, sorted: of requests that found
    prompt tokens cached (``hits``) and of those that found none (``misses``)."""

    hits: tuple[float, ...]
    misses: tuple[float, ...]


#: Bucket widths a timeline picks from (seconds): the smallest giving at most
#: the buckets asked for.
WIDTHS: Final = (5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400,
                 7 * 86400)


def timeline(core: Core, model_id: int, *, buckets: int = 48) -> Timeline | None:
    """The model's requests that the connector counted, summed per time bucket
    (one GROUP BY over its rows); None when it has none.  The buckets' width is
    the first of :data:`WIDTHS` that spans the model's rows in ``buckets`` or fewer."""
    _check_count("buckets", buckets, 1)
    with core.read() as conn:
        first, last = cast("tuple[Any, Any]",
                           conn.execute(q.REQUEST_SPAN_OF_MODEL, (model_id,)).fetchone())
        if first is None:
            return None
        for width in WIDTHS:  # buckets land on whole widths of the clock
            start = float(first) // width * width
            count = int((float(last) - start) // width) + 1
            if count <= buckets:
                break
        if count > buckets:  # older than the widest buckets hold: the newest only
            start, count = (float(last) // width - buckets + 1) * width, buckets
        rows = [Bucket(*row) for row in cast("Iterable[tuple[Any, ...]]", conn.execute(
            q.REQUEST_BUCKETS_OF_MODEL, {"start": start, "width": width, "model": model_id}))]
    return Timeline(start, float(width), count, tuple(rows))


def ttfts(core: Core, model_id: int) -> Ttfts:
    """The model's first-token times, hits' and misses' (each sorted by SQL)."""
    with core.read() as conn:
        hits, misses = (tuple(float(t) for (t,) in conn.execute(q.REQUEST_TTFTS_OF_MODEL,
                                                                 (model_id, hit)))
                        for hit in (1, 0))
    return Ttfts(hits, misses)


# -- the setting --------------------------------------------------------------------


def log_rows_setting(env: Mapping[str, str] | None = None) -> int:
    """How many rows the request log keeps: ``SPARK_KV_CACHE_LOG_ROWS`` in ``env``
    (default ``os.environ``), else :data:`DEFAULT_LOG_ROWS`.  0 means no log:
    the caller records nothing (:func:`record` itself needs ``keep`` >= 1).  A
    value that is not a whole number >= 0 raises InvalidArgument naming the
    variable."""
    env = os.environ if env is None else env
    raw = env.get(LOG_ROWS_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_LOG_ROWS
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise InvalidArgument(
            f"{LOG_ROWS_VARIABLE}={raw!r} is not valid: give the number of requests the "
            f"request log keeps, a whole number >= 0 (0: no log; default {DEFAULT_LOG_ROWS})")
    return rows
