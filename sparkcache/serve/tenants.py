"""A request's tenant, and the cache salt that keeps tenants apart (docs/serve.md, "Tenants").

The tenant of an OpenAI request (chat, completions, responses) is its
``prompt_cache_key``; of an Anthropic ``/v1/messages`` request, its
``x-sparkcache-tenant`` header (:data:`HEADER`); other routes have none.  A
request with a tenant gets the cache salt :func:`tenant_salt` makes of the
tenant and the salt the client sent, so vLLM's prefix cache and the store's
prefix hashes both partition by it, and ``kv_transfer_params.sparkcache.tenant``
names the tenant to the connector, which records it on the snapshots the request
publishes.  Pure functions over the request's JSON and headers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from sparkcache.serve.checks import Refused

__all__ = ["HEADER", "MAX_TENANT", "SALT_PREFIX", "apply_tenant", "tenant_salt"]

#: The header an Anthropic request names its tenant in (lower case, as ASGI gives it).
HEADER = "x-sparkcache-tenant"
#: The longest tenant name (OpenAI's ``prompt_cache_key`` limit).
MAX_TENANT = 1024
#: Cache salts the server makes begin so; a client's salt may not (without a tenant).
SALT_PREFIX = "t:"
#: vLLM's rules for a client's ``cache_salt``: the longest, and the characters
#: refused, by API (Anthropic's model takes 1024 characters of anything).
_SALT_RULES: dict[str | None, tuple[int, frozenset[str]]] = {
    "messages": (1024, frozenset()),
}
_OPENAI_SALT_RULE = (128, frozenset("@/\\\x00"))


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """The cache salt of a tenant's request: :data:`SALT_PREFIX` and the SHA-256
    of the tenant and the client's own salt (68 characters, within vLLM's 128)."""
    text = json.dumps([tenant, client_salt], ensure_ascii=True, separators=(",", ":"))
    return SALT_PREFIX + hashlib.sha256(text.encode("ascii")).hexdigest()


def _header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    found = [value for key, value in headers if key.lower() == HEADER.encode()]
    if not found:
        return None
    if len(found) > 1:
        raise Refused(400, f"give one {HEADER} header, not {len(found)}")
    try:
        return found[0].decode("utf-8").strip() or None
    except UnicodeDecodeError:
        raise Refused(400, f"the {HEADER} header must be UTF-8 text") from None


def _tenant(api: str | None, cache_key: str | None,
            headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's tenant (None: none); Refused when unusable."""
    if api == "messages":
        tenant, param = _header(headers), None
        name = f"the {HEADER} header"
    elif api in ("chat", "completions", "responses"):
        tenant, param, name = cache_key or None, "prompt_cache_key", "prompt_cache_key"
    else:
        return None
    if tenant is None:
        return None
    if len(tenant) > MAX_TENANT:
        raise Refused(400, f"{name} must be at most {MAX_TENANT} characters", param)
    try:
        tenant.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from a JSON \\udXXX escape
        raise Refused(400, f"{name} must be valid Unicode text", param) from None
    return tenant


def _salt_ok(api: str | None, salt: Any) -> bool:
    """Whether vLLM takes ``salt`` as the API's ``cache_salt`` (else it answers a 400)."""
    longest, refused = _SALT_RULES.get(api, _OPENAI_SALT_RULE)
    return (isinstance(salt, str) and 0 < len(salt) <= longest
            and not any(c in refused for c in salt))


def apply_tenant(api: str | None, body: dict[str, Any], headers: Iterable[tuple[bytes, bytes]],
                 cache_key: str | None) -> str | None:
    """Find the request's tenant and partition ``body`` by it (in place): its
    ``cache_salt`` becomes :func:`tenant_salt` and
    ``kv_transfer_params.sparkcache.tenant`` names it (a tenant the client wrote
    there is dropped).  A client's salt vLLM would refuse is left for vLLM to
    answer.  Returns the tenant; Refused when it is unusable, or when a request
    without one sends a salt beginning with :data:`SALT_PREFIX` (the tenants' own).
    Call after :func:`~sparkcache.serve.checks.prepare` (which checked
    ``kv_transfer_params``)."""
    tenant = _tenant(api, cache_key, headers)
    salt = body.get("cache_salt")
    params = body.get("kv_transfer_params")
    ours = params.get("sparkcache") if isinstance(params, dict) else None
    if isinstance(ours, dict):
        ours.pop("tenant", None)
    if tenant is None:
        if isinstance(salt, str) and salt.startswith(SALT_PREFIX):
            raise Refused(400, f"cache_salt values beginning with {SALT_PREFIX!r} are the "
                               "server's own (a tenant's); choose another salt", "cache_salt")
        return None
    if salt is not None and not _salt_ok(api, salt):
        return tenant  # vLLM refuses the request for its salt
    body["cache_salt"] = tenant_salt(tenant, salt)
    params = body.get("kv_transfer_params") or {}
    ours = dict(params.get("sparkcache") or {})
    ours["tenant"] = tenant
    body["kv_transfer_params"] = {**params, "sparkcache": ours}
    return tenant
