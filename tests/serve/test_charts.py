"""The page's charts (sparkcache.serve.charts) over a real store and request log:
the SQL sums per time bucket, and the SVG they draw, each with its text."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path
from typing import Any

import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.requestlog import Timeline
from sparkcache.serve import charts, page

from ..filled import fill

T0 = 1_767_000_000.0  # a whole hour of the clock


def row(i: int, at: float, prompt: int, live: int = 0, restored: int = 0, remote: int = 0,
        ttft: float | None = None, model_id: int | None = 1) -> dict[str, Any]:
    return {"request_id": f"r{i}", "created_at": at, "model_id": model_id, "api": "messages",
            "prompt_tokens": prompt, "live_tokens": live, "restored_tokens": restored,
            "remote_tokens": remote, "ttft_s": ttft, "status": 200}


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with SnapshotStore(tmp_path / "store", alias_stride=16) as opened:
        fill(opened)  # tiny-llama is model 1
        yield opened


def test_the_timeline_sums_each_bucket_in_sql(store: SnapshotStore) -> None:
    store.log_requests([
        row(1, T0 + 10, 100, live=50),
        row(2, T0 + 20, 300, restored=100, remote=40),
        row(3, T0 + 3 * 3600 + 5, 200, live=200),
        row(4, T0 + 3 * 3600 + 6, 50, model_id=2),  # another model's
        {"request_id": "r5", "created_at": T0 + 30, "model_id": 1, "status": 400},  # uncounted
    ], keep=100)
    line = store.request_timeline(1)
    assert isinstance(line, Timeline)
    # 3 h 5 s of rows: 1-minute buckets are too many for 48; 5-minute ones are not.
    assert (line.start, line.width, line.count) == (T0, 300.0, 37)
    assert [(b.index, b.requests, b.prompt_tokens, b.live_tokens, b.restored_tokens,
             b.remote_tokens) for b in line.buckets] == [(0, 2, 400, 50, 100, 40),
                                                         (36, 1, 200, 200, 0, 0)]
    assert line.buckets[0].hit_rate == 150 / 400
    assert store.request_timeline(99) is None
    assert store.request_timeline(1, buckets=4).width == 3600.0


def test_a_log_longer_than_the_widest_buckets_keeps_the_newest(store: SnapshotStore) -> None:
    store.log_requests([row(1, T0, 10), row(2, T0 + 400 * 86400, 20)], keep=100)
    line = store.request_timeline(1, buckets=10)
    assert line is not None and line.count == 10 and line.width == 7 * 86400
    assert [b.prompt_tokens for b in line.buckets] == [20]


def test_first_token_times_split_hits_from_misses(store: SnapshotStore) -> None:
    store.log_requests([row(1, T0, 100, live=32, ttft=0.05), row(2, T0, 100, ttft=0.4),
                        row(3, T0, 100, restored=64, ttft=0.03), row(4, T0, 100, ttft=None),
                        row(5, T0, 100, ttft=0.2)], keep=100)
    times = store.request_ttfts(1)
    assert times.hits == (0.03, 0.05) and times.misses == (0.2, 0.4)


def _desc(svg: str) -> str:
    found = re.search(r"<desc[^>]*>(.*?)</desc>", svg)
    assert found, svg
    return html.unescape(found.group(1))


def test_each_chart_says_in_words_what_it_draws(store: SnapshotStore) -> None:
    store.log_requests([row(1, T0 + 10, 100, live=50, ttft=0.02),
                        row(2, T0 + 20, 300, restored=100, remote=40, ttft=0.04),
                        row(3, T0 + 900, 200, ttft=0.3)], keep=100)
    line = store.request_timeline(1)
    assert line is not None
    hits = charts.hit_rate("h", line)
    assert hits.startswith('<figure><svg role="img" id="h" aria-labelledby="h-t h-d"')
    assert _desc(hits) == ("Hit rate per 30 s over 31 periods: 25% overall, 0% in the "
                           "latest, lowest 0%, highest 38%.")
    assert hits.count("<circle") == 2 and "<polyline" in hits
    tokens = charts.tokens("k", line)
    assert _desc(tokens) == ("Prompt tokens per 30 s, stacked: 50 cached live in vLLM, 60 "
                             "restored from disk, 40 from the shared tier, 450 computed, of "
                             "600 in all.")
    heights = [float(h) for h in re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="[\d.]+" '
                                            r'height="([\d.]+)"', tokens)]
    # Bucket 0: live, disk, tier, computed, as tall as the plot (the tallest bucket);
    # the last: computed, half as tall; then the legend's four squares.
    assert heights[:5] == [16.0, 19.2, 12.8, 80.0, 64.0] and heights[5:] == [10.0] * 4
    ttft = charts.ttft("t", store.request_ttfts(1))
    assert _desc(ttft) == ("Hits: median 40 ms, 90th percentile 40 ms over 2 requests. "
                           "Misses: median 300 ms, 90th percentile 300 ms over 1 requests.")
    gauge = charts.gauges("g", 3 * 2**20, 12 * 2**20, 100 * 2**30, 40 * 2**30, 5 * 2**30)
    assert _desc(gauge) == ("The model's snapshots take 3.0 MB of a 12.0 MB budget (25%). "
                            "The disk has 40.0 GB free of 100.0 GB; below 5.0 GB free, "
                            "snapshots are evicted and none saved.")
    for svg in (hits, tokens, ttft, gauge):
        assert "<title" in svg and "<figcaption>" in svg and "<script" not in svg


def test_the_page_draws_every_models_charts(store: SnapshotStore) -> None:
    store.log_requests([row(1, time.time() - 60, 100, live=50, ttft=0.02)], keep=100)
    text = page.render(store, csrf="x")
    models = {m.name: m.id for m in admin.list_models(store)}
    tiny = text.split(f'id="model-{models["tiny-llama"]}"')[1].split("</section>")[0]
    assert re.findall(r'<svg role="img" id="([a-z-]+)-\d+"', tiny) == [
        "chart-hits", "chart-tokens", "chart-store", "chart-ttft"]
    other = text.split(f'id="model-{models["other"]}"')[1].split("</section>")[0]
    assert "No requests yet: the charts over time start with the first." in other
    assert re.findall(r'<svg role="img" id="([a-z-]+)-\d+"', other) == [
        "chart-store", "chart-ttft"]
    assert "No hits yet." in other
