"""Tenants on a real ``sparkcache serve``, through the official ``openai`` and ``anthropic``.

One server (``served``, with vLLM's dev routes for ``/reset_prefix_cache`` and
``SPARK_KV_CACHE_TENANT_ENTRIES=2``) runs the tests in file order: tenant B
reads nothing of tenant A's prefix, neither from disk (vLLM's live cache reset
first) nor from vLLM's live cache (B right after A), while A reads its whole
prefix; an Anthropic request's tenant is its ``x-sparkcache-tenant`` header;
a tenant's third snapshot evicts its own oldest and nobody else's;
``sparkcache clear --tenant`` and the page's Clear of one tenant leave the
other tenants' snapshots; ``sparkcache tenants`` counts each tenant's requests
and hit rate exactly; /metrics has every series the Grafana dashboard
(docs/grafana/sparkcache.json) queries, the store's with the store's numbers.

Token counts are by hand: the chat template puts 7 tokens around one user
message (``<bos><|user|>\\n`` ... ``<|end|>\\n<|assistant|>\\n``,
:data:`serve_helpers.USER_FRAME`), one token per character; a text of 635
characters is a prompt of 642 tokens, 20 whole 32-token blocks and 2 more, so
the whole shared prefix is 640 tokens, from vLLM's live cache and from a
snapshot alike (vLLM computes the last 2 tokens: ``tiny_model.COMPUTED``).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from serve_helpers import (
    MODEL_NAME,
    USER_FRAME,
    Server,
    complete,
    last_seq,
    log_rows,
    system_prompt,
    wait_for,
    whole,
)
from tiny_model import NEEDS_VLLM

from sparkcache.store import SnapshotStore
from tests import grafana

pytestmark = NEEDS_VLLM

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
TEXT_CHARS = 635
PROMPT = 3 + TEXT_CHARS + USER_FRAME  # 642
SHARED = whole(PROMPT)  # 640


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("tenants-store")
    log = tmp_path_factory.mktemp("tenants-log") / "server.log"
    env = {"VLLM_SERVER_DEV_MODE": "1", "SPARK_KV_CACHE_TENANT_ENTRIES": "2"}
    with Server(tiny_model_dir, folder, log, env=env) as server:
        yield server


def oai(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(server: Server, text: str, key: str | None = None) -> Any:
    extra = {} if key is None else {"prompt_cache_key": key}
    answer = oai(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=4,
        temperature=0, **extra)
    assert answer.usage.prompt_tokens == PROMPT
    return answer


def cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def snapshots(server: Server) -> dict[int, str | None]:
    """Every snapshot's id and tenant."""
    with SnapshotStore(server.folder) as store:
        return {s.id: s.tenant for s in store.snapshots()}


def settled(server: Server) -> dict[int, str | None]:
    """:func:`snapshots`, once every publish has finished and nothing changed for a
    second (the saves of answers already sent land after them)."""
    seen: list[Any] = []

    def still() -> bool:
        with SnapshotStore(server.folder) as store:
            now = sorted((s.id, s.tenant, s.state) for s in store.snapshots())
        seen.append((time.monotonic(), now))
        while seen[0][1] != now:
            seen.pop(0)
        return all(state == "ready" for *_, state in now) and \
            seen[-1][0] - seen[0][0] >= 1.0

    wait_for(still)
    return snapshots(server)


def reset_live_cache(server: Server) -> None:
    """vLLM's own prefix cache emptied (retried while finished requests' blocks
    are still held for their saves)."""
    def reset() -> bool:
        request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return bool(json.loads(answer.read())["success"])

    wait_for(reset)


def sparkcache(server: Server, *argv: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "sparkcache", "--folder", str(server.folder),
                          *argv, "--json"], capture_output=True, text=True, cwd=ROOT,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def logged(server: Server, n: int, after: int, newest: int | None = None) -> list[Any]:
    """The rows logged after row ``after`` (:func:`serve_helpers.last_seq`
    before the test's requests), newest first, once there are ``n`` of them
    (each answer's row is written just after the answer, so the newest row can
    still be the request before it), all complete (the connector's part and
    the server's) and, with ``newest``, the newest has that status."""
    def ours(rows: list[Any]) -> list[Any]:
        return [r for r in rows if r.seq > after]

    return ours(log_rows(server.folder, lambda rows: len(ours(rows)) >= n and all(
        complete(r) for r in ours(rows)) and (newest is None or rows[0].status == newest)))


def test_b_cannot_read_a_s_prefix_from_disk(served: Server) -> None:
    text = system_prompt(31, TEXT_CHARS)
    after = last_seq(served.folder)
    first = chat(served, text, "tenant-a")
    assert cached(first) == 0
    wait_for(lambda: "tenant-a" in snapshots(served).values())
    reset_live_cache(served)
    # Neither another tenant nor a request without one restores A's snapshot.
    other = chat(served, text, "tenant-b")
    assert cached(other) == 0
    assert cached(chat(served, text)) == 0
    reset_live_cache(served)
    again = chat(served, text, "tenant-a")
    assert cached(again) == SHARED
    # Isolation changes nothing of the answers: computed or restored, the same.
    assert again.choices[0].message.content == first.choices[0].message.content \
        == other.choices[0].message.content
    rows = logged(served, 4, after)
    assert (rows[0].tenant, rows[0].live_tokens, rows[0].restored_tokens) == (
        "tenant-a", 0, SHARED)
    assert [(r.tenant, r.cache_key) for r in rows[:4]] == [
        ("tenant-a", "tenant-a"), (None, None), ("tenant-b", "tenant-b"),
        ("tenant-a", "tenant-a")]


def test_b_cannot_read_a_s_prefix_from_the_live_cache(served: Server) -> None:
    text = system_prompt(32, TEXT_CHARS)
    after = last_seq(served.folder)
    assert cached(chat(served, text, "tenant-a")) == 0
    assert cached(chat(served, text, "tenant-b")) == 0  # A's blocks are in vLLM's memory
    assert cached(chat(served, text, "tenant-a")) == SHARED
    assert cached(chat(served, text, "tenant-b")) == SHARED  # its own, now
    row = logged(served, 4, after)[0]
    assert (row.tenant, row.live_tokens, row.restored_tokens) == ("tenant-b", SHARED, 0)


def test_an_anthropic_request_s_tenant_is_its_header(served: Server) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    text = system_prompt(33, TEXT_CHARS)
    after = last_seq(served.folder)

    def ask(tenant: str | None) -> tuple[int, int, int]:
        headers = {} if tenant is None else {"x-sparkcache-tenant": tenant}
        u = client.messages.create(model=MODEL_NAME, max_tokens=4, extra_headers=headers,
                                   extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": text}]).usage
        return u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens

    assert ask("tenant-h") == (PROMPT, 0, 0)
    assert ask("tenant-x") == (PROMPT, 0, 0)
    assert ask(None) == (PROMPT, 0, 0)
    assert ask("tenant-h") == (PROMPT - SHARED, SHARED, 0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=4,
                               extra_headers={"x-sparkcache-tenant": "x" * 1025},
                               messages=[{"role": "user", "content": "hi"}])
    assert "at most 1024" in caught.value.message
    rows = logged(served, 5, after, newest=400)
    assert [(r.api, r.tenant, r.status) for r in rows[:5]] == [
        ("messages", None, 400), ("messages", "tenant-h", 200),
        ("messages", None, 200), ("messages", "tenant-x", 200), ("messages", "tenant-h", 200)]


def test_a_server_salt_sent_by_a_client_is_a_400(served: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai(served).chat.completions.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            extra_body={"cache_salt": "t:" + "0" * 64})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "cache_salt"
    assert "server's own" in caught.value.body["message"]


def test_a_tenant_s_limit_evicts_only_its_own_oldest(served: Server) -> None:
    before = settled(served)
    others = {i: t for i, t in before.items() if t != "tenant-c"}
    ids = []
    for seed in (41, 42, 43):
        chat(served, system_prompt(seed, TEXT_CHARS), "tenant-c")
        known = set(ids)
        ids.append(wait_for(lambda known=known: [i for i, t in snapshots(served).items()
                                                 if t == "tenant-c" and i not in known])[0])
    # SPARK_KV_CACHE_TENANT_ENTRIES=2: c's third snapshot pushed out c's first
    # (retention runs right after a publish commits: just after it shows).
    def trimmed() -> dict[int, str | None] | None:
        now = snapshots(served)
        return now if sorted(i for i, t in now.items() if t == "tenant-c") == ids[1:] else None

    after = wait_for(trimmed)
    # Every other snapshot is still there, and c's first was the only eviction.
    assert {i: t for i, t in after.items() if t != "tenant-c"} == others
    with SnapshotStore(served.folder) as store:
        assert store.stats().get("evictions.tenant_entries") == 1
        assert sum(v for k, v in store.stats().items() if k.startswith("evictions.")) == 1


def test_clear_of_a_tenant_leaves_the_others_and_tenants_counts_them(served: Server) -> None:
    before = settled(served)
    model_id = sparkcache(served, "tenants")[0]["model_id"]
    b_ids = sorted(i for i, t in before.items() if t == "tenant-b")
    assert len(b_ids) == 2
    dry = sparkcache(served, "clear", str(model_id), "--tenant", "tenant-b", "--dry-run")
    assert dry["deleted"] == b_ids and snapshots(served) == before
    done = sparkcache(served, "clear", str(model_id), "--tenant", "tenant-b", "--yes")
    assert done["deleted"] == b_ids and done["tenant"] == "tenant-b" and done["nbytes"] > 0
    assert snapshots(served) == {i: t for i, t in before.items() if t != "tenant-b"}
    rows = {r["tenant"]: r for r in sparkcache(served, "tenants")}
    # a: 642-token prompts, 640 cached twice of four; b: once of three (one logged
    # row each); c: three snapshots' prompts, nothing cached.
    got = {k: (r["snapshots"], r["requests"], r["prompt_tokens"], r["cached_tokens"],
               r["hit_rate"]) for k, r in rows.items()}
    assert got == {
        "tenant-a": (2, 4, 4 * PROMPT, 2 * SHARED, round(2 * SHARED / (4 * PROMPT), 4)),
        "tenant-b": (0, 3, 3 * PROMPT, SHARED, round(SHARED / (3 * PROMPT), 4)),
        "tenant-c": (2, 3, 3 * PROMPT, 0, 0.0),
        "tenant-h": (1, 2, 2 * PROMPT, SHARED, round(SHARED / (2 * PROMPT), 4)),
        "tenant-x": (1, 1, PROMPT, 0, 0.0),
    }


def test_the_page_clears_one_tenant(served: Server) -> None:
    with urllib.request.urlopen(served.url + "/sparkcache", timeout=30) as answer:
        page = answer.read().decode()
    assert "<dt>per tenant</dt><dd>2 snapshots</dd>" in page  # the server's limit
    rows = re.findall(r'<tr><td class="l">([^<]*)</td><td>(\d+)</td>', page)
    assert sorted((html.unescape(n), int(c)) for n, c in rows) == [
        ("tenant-a", 2), ("tenant-b", 0), ("tenant-c", 2), ("tenant-h", 1), ("tenant-x", 1)]
    # The forms in the order of the rows: most requests first (a: 4, then b and c: 3).
    forms = re.findall(r'name="model" value="(\d+)"><input type="hidden" name="tenant" '
                       r'value="([0-9a-f]{32})"', page)
    # The Clear forms' token (the playground's form carries one of its own).
    csrf = html.unescape(re.findall(r'name="tenant" value="[0-9a-f]{32}">'
                                    r'<input type="hidden" name="csrf" value="([^"]+)"', page)[0])
    names = [html.unescape(n) for n, _c in rows]
    model_id, ref = forms[names.index("tenant-c")]
    before = settled(served)
    request = urllib.request.Request(
        served.url + "/sparkcache/clear", method="POST",
        data=urlencode({"model": model_id, "tenant": ref, "csrf": csrf}).encode(),
        headers={"content-type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(request, timeout=30) as answer:  # follows the 303
        assert "Cleared 2 snapshots of tenant tenant-c of" in html.unescape(answer.read().decode())
    assert snapshots(served) == {i: t for i, t in before.items() if t != "tenant-c"}


def test_per_tenant_counters_reach_prometheus(served: Server) -> None:
    """vLLM's /metrics has the connector's counters per tenant label: A's one
    restore from disk (640 tokens, the first test); B never restored one."""
    def series() -> dict[str, float]:
        with urllib.request.urlopen(served.url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
        found = re.findall(r'^vllm:sparkcache_tenant_hit_tokens_total\{([^}]*)\} (\S+)$', text,
                           re.MULTILINE)
        return {dict(re.findall(r'(\w+)="([^"]*)"', labels))["tenant"]: float(value)
                for labels, value in found}

    got = wait_for(lambda: series().get("tenant-a"))
    assert got == SHARED
    assert series().get("tenant-b", 0.0) == 0.0



def exported(server: Server) -> dict[str, list[Any]]:
    """The samples of every metric family on the server's /metrics, by series name
    (a counter family's ``_total`` and ``_created`` series included)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        names = {family.name, f"{family.name}_total"} if family.type == "counter" else {
            family.name}
        for name in names:
            out.setdefault(name, [])
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_every_metric_the_grafana_dashboard_queries_is_exported(served: Server) -> None:
    """docs/grafana/sparkcache.json names only series that /metrics has (after
    the tests above: snapshots stored, one evicted by a tenant's limit); the
    store's gauges and evictions are the store's own numbers."""
    wanted = grafana.metric_names(grafana.load())
    assert {"vllm:sparkcache_hits_total", "vllm:sparkcache_store_bytes",
            "vllm:sparkcache_store_evictions_total"} <= wanted, wanted
    series = exported(served)
    unknown = sorted(n for n in wanted if n not in series)
    assert not unknown, f"the dashboard queries metrics /metrics does not export: {unknown}"

    def store_numbers() -> tuple[dict[str, float], dict[str, float]] | None:
        with SnapshotStore(served.folder) as store:
            (model,) = [m for m in store.catalog.models() if m.deleted_at is None]
            counters = store.stats()
        size = {"bytes": float(model.nbytes), "snapshots": float(model.snapshots)}
        evictions = {k.removeprefix("evictions."): float(v) for k, v in counters.items()
                     if k.startswith("evictions.")}
        got = exported(served)
        mine = {"model": model.name, "digest": model.digest[:12]}
        got_size = {name: sum(s.value for s in got[f"vllm:sparkcache_store_{name}"]
                              if s.labels == mine) for name in size}
        got_evictions = {s.labels["reason"]: s.value
                         for s in got["vllm:sparkcache_store_evictions_total"]
                         if {k: s.labels[k] for k in mine} == mine}
        return (size, evictions) if (got_size, got_evictions) == (size, evictions) else None

    size, evictions = wait_for(store_numbers)
    assert size["bytes"] > 0 and size["snapshots"] > 0
    assert evictions.get("tenant_entries", 0) >= 1, evictions
