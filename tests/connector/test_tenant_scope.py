"""The connector reads a request's tenant from kv_transfer_params into its scope."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sparkcache.connector.requests import scope_of
from sparkcache.identity import RequestScope


def request(tenant: Any = None, salt: str | None = "t:abc") -> SimpleNamespace:
    params = None if tenant is None else {"sparkcache": {"id": "r", "tenant": tenant}}
    return SimpleNamespace(request_id="r", cache_salt=salt, lora_request=None, mm_features=[],
                           kv_transfer_params=params)


def test_the_tenant_joins_the_scope() -> None:
    assert scope_of(request("alice")) == RequestScope(cache_salt="t:abc", tenant="alice")
    assert scope_of(request(None, None)) is None
    assert scope_of(request("alice", None)) == RequestScope(tenant="alice")


def test_a_malformed_tenant_is_ignored() -> None:
    for bad in ("", "x" * 1025, 5, ["a"], "a\ud800"):
        assert scope_of(request(bad)) == RequestScope(cache_salt="t:abc")
