"""The engine's warm-up never stops the server: no engine, a failing one and a
silent one are logged and given up (tests/vllm/test_serve.py warms a real one)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from sparkcache.serve import warmup

pytest.importorskip("vllm", reason="needs vLLM (bash scripts/install-vllm.sh)")


class Engine:
    """An engine client whose ``generate`` fails, or never answers."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.asked = fail, []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.asked.append((prompt, params, request_id))
        if self.fail:
            raise RuntimeError("engine dead")
        await asyncio.sleep(60)
        yield None


def app(engine: Any) -> Any:
    return SimpleNamespace(state=SimpleNamespace(engine_client=engine))


@pytest.mark.parametrize("fail", [True, False])
def test_a_failed_or_silent_warm_up_is_logged_and_given_up(
        fail: bool, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(fail)
    with caplog.at_level(logging.WARNING, logger="sparkcache.serve"):
        assert asyncio.run(warmup.warm_up(app(engine), timeout=0.2)) is False
    ((prompt, params, request_id),) = engine.asked
    assert prompt == {"prompt_token_ids": [0] * warmup.PROMPT_TOKENS}
    assert params.max_tokens == 1
    assert params.logprobs == 1  # compiles vLLM's logprob helper before the first request
    assert params.extra_args == {"kv_transfer_params": {"sparkcache": {"cache": False}}}
    assert request_id.startswith(warmup.REQUEST_PREFIX)
    assert "warm-up failed" in caplog.text
    assert ("RuntimeError" if fail else "TimeoutError") in caplog.text


def test_no_engine_no_warm_up() -> None:
    assert asyncio.run(warmup.warm_up(SimpleNamespace())) is False


@pytest.mark.parametrize(("value", "wanted"), [(None, True), ("1", True), ("0", False),
                                               (" 0 ", False), ("yes", True)])
def test_sparkcache_warm_up_0_turns_it_off(value: str | None, wanted: bool) -> None:
    env = {} if value is None else {warmup.ENV_WARM_UP: value}
    assert warmup.wanted(env) is wanted
