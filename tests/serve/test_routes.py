"""Every route that reaches the engine goes through the middleware, driven as an
ASGI app over a real store: the row's key is the server's whatever the client
sent, and a body over the limit is refused before it is read."""

from __future__ import annotations

import json
import re

import pytest

from sparkcache import SnapshotStore

from .test_page_access import Server, server, stored

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from sparkcache.serve.middleware import ROUTES

pytestmark = pytest.mark.vllm
__all__ = ["server", "stored"]  # the fixtures this module uses


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_client_chosen_log_id_is_replaced_on_every_engine_route(server: Server,
                                                                  path: str) -> None:
    request = {"model": "tiny", "prompt": "hi", "token_ids": [1, 2],
               "kv_transfer_params": {"other": 1, "sparkcache": {"id": "victim"}}}
    r = server.call("POST", path, body=json.dumps(request).encode())
    assert r.status == 200
    ((_scope, seen),) = server.inner.calls
    params = json.loads(seen)["kv_transfer_params"]
    assert params["other"] == 1
    assert re.fullmatch(r"sc-[0-9a-f]{32}", params["sparkcache"]["id"])
    with SnapshotStore(server.folder) as store:
        row = store.request(params["sparkcache"]["id"])
        assert store.request("victim") is None
    assert row is not None and row.status == 200
    assert row.api == (ROUTES[path] or ("completions" if path == "/invocations" else None))


def test_a_declared_body_over_the_limit_is_refused_unread(server: Server) -> None:
    limit = server.app.settings.max_body
    r = server.call("POST", "/v1/messages", body=b"{}",
                    headers=[("content-length", str(limit + 1))])
    assert r.status == 413
    assert json.loads(r.body)["error"]["type"] == "request_too_large"
    assert not server.inner.calls
