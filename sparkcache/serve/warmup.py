"""The engine's warm-up: one tiny request before ``sparkcache serve`` answers any.

A new vLLM engine's first request pays one-time costs of its own (the
engine's first step: thread pools, allocator and kernel set-up; and the first
request asking for logprobs compiles vLLM's logprob helper with
``torch.compile``), in plain vLLM as in sparkcache, so a fresh server's
first restore, the one a restart exists for, would be slower than every
later one (docs/benchmarks.md has the figures).  The middleware
(:mod:`sparkcache.serve.middleware`) runs :func:`warm_up` while the server
starts (ASGI ``lifespan.startup``, before uvicorn accepts the first
request): it sends the engine, in process, :data:`PROMPT_TOKENS` tokens to
answer with one token and its logprob, marked ``"cache": false`` so the
connector neither restores nor saves for it; the request log shows it under
the id :data:`REQUEST_PREFIX` + a random suffix.

A warm-up that fails or takes longer than :data:`TIMEOUT_S` is logged and
given up: the server starts all the same.  ``SPARKCACHE_WARM_UP=0`` turns
it off.  vLLM is imported lazily, so importing this module needs no vLLM.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_WARM_UP", "PROMPT_TOKENS", "REQUEST_PREFIX", "TIMEOUT_S", "wanted",
           "warm_up"]

logger = logging.getLogger("sparkcache.serve")

#: The environment variable that turns the warm-up off (``0``).
ENV_WARM_UP = "SPARKCACHE_WARM_UP"
#: The warm-up prompt's length (token id 0 repeated: any model's vocabulary has it).
PROMPT_TOKENS = 16
#: The warm-up's request id starts with this (its request log row's too).
REQUEST_PREFIX = "sparkcache-warmup-"
#: The longest a warm-up may hold the server's start.
TIMEOUT_S = 120.0


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the warm-up runs (``SPARKCACHE_WARM_UP`` unset or not ``0``)."""
    return env.get(ENV_WARM_UP, "1").strip() != "0"


async def _answer(engine: Any) -> int:
    """One greedy token for the warm-up prompt, with its logprob (what compiles
    vLLM's logprob helper); the tokens generated."""
    vllm: Any = importlib.import_module("vllm")
    params = vllm.SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=1,
        extra_args={"kv_transfer_params": {"sparkcache": {"cache": False}}})
    prompt = {"prompt_token_ids": [0] * PROMPT_TOKENS}
    generated = 0
    async for out in engine.generate(prompt, params, REQUEST_PREFIX + uuid.uuid4().hex[:12]):
        generated = len(out.outputs[0].token_ids) if out.outputs else generated
    return generated


async def warm_up(app: Any, *, timeout: float = TIMEOUT_S) -> bool:
    """Run the warm-up on ``app``'s engine (vLLM's ``app.state.engine_client``).

    Args:
        app: vLLM's FastAPI application (an ASGI scope's ``app``).
        timeout: seconds the warm-up may take before it is given up.

    Returns:
        Whether the engine answered it; a failure is logged, never raised.
    """
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    if engine is None:
        logger.info("sparkcache: no engine to warm up")
        return False
    started = time.perf_counter()
    try:
        generated = await asyncio.wait_for(_answer(engine), timeout)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # never stops the server: its first request pays instead
        logger.warning("sparkcache: the engine's warm-up failed (%s: %s); the first "
                       "request pays the engine's one-time set-up",
                       type(exc).__name__, str(exc)[:200])
        return False
    logger.info("sparkcache: engine warmed up in %.2f s (%d token)",
                time.perf_counter() - started, generated)
    return True
