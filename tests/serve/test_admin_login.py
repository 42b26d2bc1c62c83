"""The admin token's rules, driven as an ASGI app over a real store: a token no
header can carry is refused at start, failed attempts are bounded per client
address, a session expires, and a form larger than 4 KB is refused unread."""

from __future__ import annotations

import pytest

from sparkcache.errors import InvalidArgument
from sparkcache.serve import launch

from .test_page_access import TOKEN, Server, Stored, guarded, stored

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")
from sparkcache.serve.middleware import ServeSettings

pytestmark = pytest.mark.vllm
__all__ = ["guarded", "stored"]  # the fixtures this module uses


@pytest.mark.parametrize("token", ["caf\u00e9", "\u2603", " padded", "tab\tbed", "new\nline"])
def test_a_token_no_header_can_carry_is_refused_at_start(stored: Stored, token: str) -> None:
    """HTTP headers are latin-1: a non-ASCII token could never be sent as Bearer."""
    with pytest.raises(InvalidArgument, match="printable ASCII"):
        ServeSettings(folder=str(stored.folder), admin_token=token)
    with pytest.raises(InvalidArgument, match="--admin-token: the admin token must be"):
        launch.build(["model", "--folder", str(stored.folder), "--admin-token", token], env={})


def test_failed_attempts_are_bounded_per_client(guarded: Server) -> None:
    """Five wrong tokens (form or Bearer) from one address within a minute: that
    address gets 429 until they are a minute old, the right token included;
    another address is not held up, and nothing is read of a held-up login."""
    now = [1_000_000.0]
    admin_rules = guarded.app.pages.admin
    assert admin_rules is not None
    admin_rules.clock = lambda: now[0]
    attacker, other = ("10.0.0.5", 1), ("10.0.0.6", 1)
    for n in range(5):
        if n % 2:
            r = guarded.page(client=attacker, headers=[("authorization", f"Bearer wrong{n}")])
        else:
            r = guarded.post_form("/sparkcache/login", {"token": f"wrong{n}"}, client=attacker)
        assert r.status == 401, n
    for attempt in ({"token": TOKEN}, {"token": "again"}):
        r = guarded.post_form("/sparkcache/login", attempt, client=attacker)
        assert r.status == 429 and r.header("retry-after") == "60"
        assert r.header("set-cookie") is None
    assert guarded.page(client=attacker, headers=[("authorization", f"Bearer {TOKEN}")]
                        ).status == 429
    assert guarded.post_form("/sparkcache/login", {"token": TOKEN}, client=other).status == 303
    now[0] += 61
    assert guarded.post_form("/sparkcache/login", {"token": TOKEN}, client=attacker).status \
        == 303


def test_a_session_expires(guarded: Server) -> None:
    now = [2_000_000.0]
    admin_rules = guarded.app.pages.admin
    assert admin_rules is not None
    admin_rules.clock = lambda: now[0]
    r = guarded.post_form("/sparkcache/login", {"token": TOKEN})
    cookie = (r.header("set-cookie") or "").split(";")[0]
    assert guarded.page(headers=[("cookie", cookie)]).status == 200
    now[0] += 12 * 3600 + 1
    assert guarded.page(headers=[("cookie", cookie)]).status == 401


@pytest.mark.parametrize("path", ["/sparkcache/login", "/sparkcache/clear"])
def test_a_form_larger_than_4_kb_is_refused_unread(guarded: Server, path: str) -> None:
    auth = [("authorization", f"Bearer {TOKEN}")] if path.endswith("clear") else []
    r = guarded.post_form(path, {"token": TOKEN, "pad": "x" * 5000}, headers=auth)
    assert r.status == 413
    assert r.header("set-cookie") is None
    assert "larger than 4096 bytes" in r.text
