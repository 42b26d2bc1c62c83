"""Breakpoints' token positions, from vLLM's own renderer.

A mark's position is where the prompt rendered up to its block stops agreeing
with the whole prompt: whatever the chat template does with the blocks, it is
a prefix of the real prompt.  The connector finds that position in the
prompt vLLM computes (a breakpoint's ``prefix``), so the whole prompt is
rendered here only for an implicit mark (its length) and for diagnostics.
:class:`Renderer` renders through the server's ``serving_render`` (the same
code ``/v1/messages`` prefills with) and remembers renders by content, so that
a shared system prompt is rendered once.  Anthropic requests render
through ``render_messages_request``, OpenAI chat completions and Responses
requests through ``render_chat_request`` and ``render_responses_request``
(their cuts: :mod:`sparkcache.serve.openai_cache`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from sparkcache.serve.bodies import Scope, dumps
from sparkcache.serve.cache_control import Cut, strip
from sparkcache.serve.openai_cache import IMPLICIT

__all__ = ["RENDER_CACHE", "Renderer"]

logger = logging.getLogger("sparkcache.serve")

#: Renders of request prefixes remembered (a shared system prompt is rendered once).
RENDER_CACHE = 256


class Renderer:
    """Token positions of a request's marks; one per server process."""

    def __init__(self) -> None:
        self._renders: OrderedDict[str, list[int]] = OrderedDict()

    async def positions(self, scope: Scope, body: dict[str, Any], marks: list[Cut],
                        api: str = "messages") -> list[dict[str, Any]]:
        """Each mark's breakpoint for the connector, with its ttl: the render of
        the prompt cut at the mark (``prefix``; the connector places the
        breakpoint where those tokens stop agreeing with the prompt vLLM
        computes, which is this renderer's render of the whole request), so the
        whole prompt is not rendered here once more; the implicit mark's is the
        prompt's length (``at``: the whole prompt rendered).  A mark whose
        render fails is left out (logged); when the whole prompt does not
        render, the implicit mark is not set (vLLM then answers the request
        with its own error)."""
        full: list[int] | None = None
        if any(mark.where == IMPLICIT for mark in marks):
            full = await self.render(scope, strip(body), api)
        positions: list[dict[str, Any]] = []
        for mark in marks:
            if mark.where == IMPLICIT:
                if full is not None:
                    positions.append({"at": len(full), "ttl": mark.ttl})
                continue
            tokens = await self.render(scope, mark.body, api)
            if tokens is None:
                logger.warning("sparkcache: the prompt up to %s does not render; "
                               "no breakpoint there", mark.where)
                continue
            positions.append({"prefix": tokens, "ttl": mark.ttl})
        return positions

    async def render(self, scope: Scope, body: dict[str, Any],
                     api: str = "messages") -> list[int] | None:
        """The token ids vLLM's own renderer makes of an ``api`` request
        ("messages", "chat", "responses"), the same as its route prefills
        (remembered by content)."""
        body = copy.deepcopy(body)
        body.pop("kv_transfer_params", None)
        body.pop("stream_options", None)
        body["stream"] = False
        key = hashlib.sha256(api.encode() + dumps(body)).hexdigest()
        if key in self._renders:
            self._renders.move_to_end(key)
            return self._renders[key]
        renderer = getattr(getattr(scope.get("app"), "state", None), "serving_render", None)
        if renderer is None:
            logger.warning("sparkcache: this vLLM server has no renderer; "
                           "no breakpoint is set")
            return None
        try:
            result = await _render(renderer, api, body)
        except Exception as exc:  # a breakpoint is never worth a failed request
            logger.warning("sparkcache: render failed (%s: %s); no breakpoint there",
                           type(exc).__name__, exc)
            return None
        tokens = getattr(result, "token_ids", None)
        if not isinstance(tokens, list):
            logger.debug("sparkcache: render answered %s", result)
            return None
        self._renders[key] = tokens
        if len(self._renders) > RENDER_CACHE:
            self._renders.popitem(last=False)
        return tokens


async def _render(renderer: Any, api: str, body: dict[str, Any]) -> Any:
    """``serving_render``'s answer for a request of ``api``."""
    # vLLM's own request models: imported here, where vLLM's server has loaded them,
    # so that the page and the checks load without vLLM.
    if api == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await renderer.render_chat_request(ChatCompletionRequest.model_validate(body))
    if api == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return await renderer.render_responses_request(ResponsesRequest.model_validate(body))
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    return await renderer.render_messages_request(AnthropicMessagesRequest.model_validate(body))
