"""The ``/sparkcache`` page's render time with 10,000 request-log rows and 1,000 snapshots.

    .venv/bin/python bench/page_bench.py [--quick] [--json] [--dir FOLDER]

One model: one published snapshot and 999 bulk-inserted ones, and a request
log of 10,000 rows over the last 24 hours (two in three hits, with live,
restored and shared-tier tokens and first-token times).  Timed, interleaved:
a GET of ``/sparkcache`` through :class:`~sparkcache.serve.middleware.SparkCacheMiddleware`
in process (the whole answer: access check, the index thread, HTML with the
playground and charts), ``page.render`` alone, and the charts alone, against
the 200 ms budget; and the same GET on an empty log, the cost of an idle page.
docs/benchmarks.md records the result.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from common import (
    BULK_FLUSH_ROWS,
    Bulk,
    Part,
    Row,
    Sizes,
    lat,
    main,
    ms,
    open_index,
    pct,
    tiny_identity,
    tiny_pages,
)

from sparkcache import SnapshotStore
from sparkcache.serve import charts, page

SNAPSHOTS = 1_000
LOG_ROWS = 10_000
BUDGET_S = 0.200
#: vLLM's app as the page reads it (the served model's name).
APP = SimpleNamespace(state=SimpleNamespace(openai_serving_models=SimpleNamespace(
    base_model_paths=[SimpleNamespace(name="bench")])))


def fill(root: Path, rng: np.random.Generator, rows: int) -> tuple[SnapshotStore, int]:
    """The store: 1,000 snapshots of one model and ``rows`` request-log rows."""
    ident = tiny_identity("bench/page-model")
    store = SnapshotStore(root)
    toks = rng.integers(0, 128_000, 512, dtype=np.uint32)
    store.publish(ident, 0, toks, tiny_pages(ident, toks.size))
    index = open_index(root)
    bulk = Bulk.of_model(store, index, ident, rng)
    now = time.time()
    for _ in range(SNAPSHOTS - 1):
        bulk.add(int(rng.integers(32, 257)), now - float(rng.random()) * 86400)
        if bulk.pending_rows() >= BULK_FLUSH_ROWS:
            bulk.flush(index)
    bulk.flush(index)
    bulk.check(store)
    index.close()
    model_id = bulk.model_id
    batch: list[dict[str, Any]] = []
    for i in range(rows):
        prompt = int(rng.integers(200, 8000))
        hit = rng.random() < 2 / 3
        cached = int(prompt * rng.random()) if hit else 0
        restored = cached // 2 if hit and rng.random() < 0.5 else 0
        batch.append({
            "request_id": f"bench-{i}", "created_at": now - 86400 + 86400 * i / rows,
            "model_id": model_id, "model": "bench", "api": "messages",
            "prompt_tokens": prompt, "live_tokens": cached - restored,
            "restored_tokens": restored, "remote_tokens": restored // 4,
            "written_tokens": int(rng.integers(0, 512)), "output_tokens": 64,
            "ttft_s": (0.02 if hit else 0.2) * (1 + float(rng.random())),
            "total_s": 1.0, "status": 200})
        if len(batch) == 1000:
            store.log_requests(batch, keep=LOG_ROWS)
            batch.clear()
    if batch:
        store.log_requests(batch, keep=LOG_ROWS)
    return store, model_id


def get_page(app: Any, *, charted: bool = True) -> float:
    """One GET /sparkcache through the middleware, in process; its seconds."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": page.PATH, "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8000")], "client": ("127.0.0.1", 1),
             "app": APP}
    started = time.perf_counter()
    asyncio.run(app(scope, receive, send))
    took = time.perf_counter() - started
    if sent[0]["status"] != 200 or (b"chart-hits" in sent[-1]["body"]) != charted:
        raise SystemExit(f"the page answered {sent[0]['status']}: {sent[-1]['body'][:200]!r}")
    return took


def middleware(root: Path) -> Any:
    from sparkcache.serve.middleware import ServeSettings, SparkCacheMiddleware

    async def nothing(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the page never reaches vLLM")

    return SparkCacheMiddleware(nothing, ServeSettings(folder=str(root), log_rows=LOG_ROWS))


def run(scratch: Path, sz: Sizes, rng: np.random.Generator) -> list[Row]:
    reps = 10 if sz.lookup_reps < 400 else 40
    store, model_id = fill(scratch / "full", rng, LOG_ROWS)
    fill(scratch / "empty", rng, 0)
    full_app, empty_app = middleware(scratch / "full"), middleware(scratch / "empty")
    held = (len(store.snapshots()), store.request_summary(model_id=model_id).requests)
    if held != (SNAPSHOTS, LOG_ROWS):
        raise SystemExit(f"the store holds {held[0]} snapshots and {held[1]} log rows, "
                         f"not {SNAPSHOTS} and {LOG_ROWS}")
    nbytes = sum(s.nbytes for s in store.snapshots())
    samples: dict[str, list[float]] = {"get": [], "render": [], "charts": [], "empty": []}
    for _ in range(reps):
        samples["get"].append(get_page(full_app))
        started = time.perf_counter()
        page.render(store, csrf="x")
        samples["render"].append(time.perf_counter() - started)
        started = time.perf_counter()
        charts.model_charts(store, model_id, nbytes)
        samples["charts"].append(time.perf_counter() - started)
        samples["empty"].append(get_page(empty_app, charted=False))
    for app in (full_app, empty_app):
        app._db.shutdown(wait=True)
    p90 = pct(samples["get"], 90)
    size = f"{LOG_ROWS} log rows, {SNAPSHOTS} snapshots"
    return [
        Row("page. GET /sparkcache, " + size, lat(samples["get"]), ms(BUDGET_S),
            f"{p90 / BUDGET_S:.2f}x (p90)", "p90 <= 200 ms", p90 <= BUDGET_S,
            f"{reps} GETs in process", raw={"seconds": samples["get"]}),
        Row("page. page.render alone", lat(samples["render"]), raw={"seconds": samples["render"]}),
        Row("page. the charts of the model", lat(samples["charts"]),
            raw={"seconds": samples["charts"]}),
        Row("page. GET /sparkcache, empty log", lat(samples["empty"]),
            note="1,000 snapshots, no requests", raw={"seconds": samples["empty"]}),
    ]


if __name__ == "__main__":
    raise SystemExit(main([Part("page", "the /sparkcache page", run)], script="page_bench.py"))
