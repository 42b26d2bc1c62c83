"""A request's tenant and its cache salt (sparkcache.serve.tenants): pure rules."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from sparkcache.serve.checks import Refused, prepare
from sparkcache.serve.tenants import HEADER, apply_tenant, tenant_salt


def salt_of(tenant: str, client: str | None = None) -> str:
    text = json.dumps([tenant, client], separators=(",", ":"))
    return "t:" + hashlib.sha256(text.encode()).hexdigest()


def applied(api: str | None, body: dict[str, Any],
            headers: list[tuple[bytes, bytes]] | None = None) -> tuple[str | None, dict[str, Any]]:
    _marks, key = prepare(api, body)
    return apply_tenant(api, body, headers or [], key), body


def test_openai_tenant_is_the_prompt_cache_key() -> None:
    for api in ("chat", "completions", "responses"):
        tenant, body = applied(api, {"model": "m", "prompt_cache_key": "alice"})
        assert tenant == "alice"
        assert body["cache_salt"] == salt_of("alice") == tenant_salt("alice", None)
        assert len(body["cache_salt"]) == 66
        assert body["kv_transfer_params"] == {"sparkcache": {"tenant": "alice"}}
        # vLLM knows prompt_cache_key on Responses only.
        assert ("prompt_cache_key" in body) == (api == "responses")


def test_a_client_salt_is_kept_inside_the_tenant() -> None:
    tenant, body = applied("chat", {"prompt_cache_key": "alice", "cache_salt": "s1",
                                    "kv_transfer_params": {"x": 1, "sparkcache": {"id": "z"}}})
    assert tenant == "alice" and body["cache_salt"] == salt_of("alice", "s1")
    assert body["kv_transfer_params"] == {"x": 1, "sparkcache": {"id": "z", "tenant": "alice"}}
    assert salt_of("alice", "s1") not in (salt_of("alice"), salt_of("alice", "s2"),
                                          salt_of("bob", "s1"))


def test_a_salt_vllm_refuses_is_left_for_vllm() -> None:
    for salt in ("", "a/b", "x" * 129, 7):
        _tenant, body = applied("chat", {"prompt_cache_key": "alice", "cache_salt": salt})
        assert body["cache_salt"] == salt and "kv_transfer_params" not in body
    # Anthropic's request model takes 1024 characters of anything.
    _tenant, body = applied("messages", {"cache_salt": "a/" * 500},
                            [(HEADER.encode(), b"alice")])
    assert body["cache_salt"] == salt_of("alice", "a/" * 500)


def test_anthropic_tenant_is_the_header() -> None:
    tenant, body = applied("messages", {"model": "m", "max_tokens": 1, "messages": []},
                           [(b"X-SparkCache-Tenant", " b\xc3\xa9 ".encode("latin-1"))])
    assert tenant == "b\u00e9" and body["cache_salt"] == salt_of("b\u00e9")
    # prompt_cache_key means nothing to Anthropic; no header: no tenant.
    tenant, body = applied("messages", {"prompt_cache_key": "alice"})
    assert tenant is None and "cache_salt" not in body
    with pytest.raises(Refused, match="one x-sparkcache-tenant header"):
        applied("messages", {}, [(HEADER.encode(), b"a"), (HEADER.encode(), b"b")])
    with pytest.raises(Refused, match="UTF-8"):
        applied("messages", {}, [(HEADER.encode(), b"\xff")])
    with pytest.raises(Refused, match="at most 1024"):
        applied("messages", {}, [(HEADER.encode(), b"x" * 1025)])


def test_no_tenant_leaves_the_salt_and_drops_a_forged_tenant() -> None:
    tenant, body = applied("chat", {"cache_salt": "mine",
                                    "kv_transfer_params": {"sparkcache": {"tenant": "alice"}}})
    assert tenant is None and body["cache_salt"] == "mine"
    assert body["kv_transfer_params"] == {"sparkcache": {}}
    tenant, body = applied("chat", {"prompt_cache_key": ""})
    assert tenant is None and "cache_salt" not in body
    # Raw routes have no tenant: their salt is their own partition.
    tenant, body = applied(None, {"cache_salt": "raw", "prompt_cache_key": "alice"})
    assert tenant is None and body["cache_salt"] == "raw"


def test_the_tenants_salts_are_the_server_s_own() -> None:
    for api in ("chat", "messages", None):
        with pytest.raises(Refused, match="server's own") as info:
            applied(api, {"cache_salt": salt_of("alice")})
        assert info.value.param == "cache_salt" and info.value.status == 400
    # With a tenant such a salt is only the client's salt, hashed in.
    _tenant, body = applied("chat", {"prompt_cache_key": "bob", "cache_salt": salt_of("alice")})
    assert body["cache_salt"] == salt_of("bob", salt_of("alice"))


def test_a_lone_surrogate_key_is_refused() -> None:
    body = json.loads('{"prompt_cache_key": "a\\ud800"}')
    with pytest.raises(Refused, match="valid Unicode") as info:
        applied("chat", body)
    assert info.value.param == "prompt_cache_key"
