"""The page's tenants: a row per tenant of each model, and a Clear of one tenant."""

from __future__ import annotations

import html
import re
from urllib.parse import unquote

import pytest

from sparkcache import SnapshotStore
from sparkcache.identity import RequestScope

from ..store.helpers import identity, pages_for, tokens

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from .test_page_access import Server, Stored, csrf_of, server, stored

__all__ = ["server", "stored"]  # the fixtures

EVIL = "<b>x</b>\x1b\n"


@pytest.fixture
def tenanted(stored: Stored) -> dict[str, list[int]]:
    """tiny-llama gains snapshots of tenants alice (2) and EVIL (1)."""
    ident = identity()
    out: dict[str, list[int]] = {}
    with SnapshotStore(stored.folder, alias_stride=16) as store:
        for seed, tenant in ((21, "alice"), (22, "alice"), (23, EVIL)):
            toks = tokens(32, seed=seed)
            sid = store.publish(ident, 0, toks, pages_for(ident, toks),
                                scope=RequestScope(cache_salt="s", tenant=tenant)).snapshot_id
            out.setdefault(tenant, []).append(sid)
    return out


def test_each_tenant_has_a_row_and_a_clear(server: Server, stored: Stored,
                                           tenanted: dict[str, list[int]]) -> None:
    text = server.page().text
    tiny = stored.models["tiny-llama"]
    section = text.split(f'id="model-{tiny}"')[1].split("</section>")[0]
    rows = re.findall(r'<tr><td class="l">([^<]*)</td><td>(\d+)</td>', section)
    assert [(html.unescape(name), int(n)) for name, n in rows] == [
        ("alice", 2), ("<b>x</b>\\x1b\\n", 1)]
    assert "<b>x</b>" not in section  # escaped
    assert f'id="clear-{tiny}-t0"' in section and f'id="clear-{tiny}-t1"' in section
    other = text.split(f'id="model-{stored.models["other"]}"')[1].split("</section>")[0]
    assert "<h3>Tenants</h3>" not in other
    assert "<dt>per tenant</dt><dd>no limit beyond the model&#x27;s</dd>" in section


def test_clear_of_one_tenant_leaves_the_others(server: Server, stored: Stored,
                                               tenanted: dict[str, list[int]]) -> None:
    page = server.page()
    csrf = csrf_of(page)
    refs = re.findall(r'name="tenant" value="([0-9a-f]{32})"', page.text)
    assert len(refs) == 2
    r = server.post_form("/sparkcache/clear", {"model": "1", "tenant": refs[1], "csrf": csrf})
    assert r.status == 303
    assert unquote(r.header("location") or "").endswith(
        "Cleared 1 snapshot of tenant <b>x</b>\\x1b\\n of tiny-llama")
    left = server.snapshots()["tiny-llama"]
    assert left == stored.ids["tiny-llama"] + tenanted["alice"]
    # A tenant the model does not have, a malformed one, a foreign form: nothing goes.
    r = server.post_form("/sparkcache/clear", {"model": "1", "tenant": refs[1], "csrf": csrf})
    assert "no such tenant" in unquote(r.header("location") or "")
    r = server.post_form("/sparkcache/clear", {"model": "1", "tenant": "alice", "csrf": csrf})
    assert r.status == 400
    r = server.post_form("/sparkcache/clear", {"model": "1", "tenant": refs[0], "csrf": "x"})
    assert r.status == 403
    assert server.snapshots()["tiny-llama"] == left
