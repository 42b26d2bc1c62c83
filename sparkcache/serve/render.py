"""Breakpoints' token positions, from vLLM's own renderer.

A mark's position is where the prompt rendered up to its block stops agreeing
with the whole prompt (:func:`~sparkcache.serve.cache_control.common_prefix`):
whatever the chat template does with the blocks, it is a prefix of the real
prompt.  :class:`Renderer` renders through the server's ``serving_render`` (the
same code ``/v1/messages`` prefills with) and remembers renders by content, so
that a shared system prompt is rendered once.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from sparkcache.serve.bodies import Scope, dumps
from sparkcache.serve.cache_control import Cut, common_prefix, strip

__all__ = ["RENDER_CACHE", "Renderer"]

logger = logging.getLogger("sparkcache.serve")

#: Renders of request prefixes remembered (a shared system prompt is rendered once).
RENDER_CACHE = 256


class Renderer:
    """Token positions of a request's marks; one per server process."""

    def __init__(self) -> None:
        self._renders: OrderedDict[str, list[int]] = OrderedDict()

    async def positions(self, scope: Scope, body: dict[str, Any],
                        marks: list[Cut]) -> list[dict[str, Any]]:
        """Each mark's token position and ttl.  A mark whose render fails is left
        out (logged); when the whole prompt does not render, none is set (vLLM
        then answers the request with its own error)."""
        full = await self.render(scope, strip(body))
        if full is None:
            return []
        positions: list[dict[str, Any]] = []
        for mark in marks:
            tokens = await self.render(scope, mark.body)
            if tokens is None:
                logger.warning("sparkcache: the prompt up to %s does not render; "
                               "no breakpoint there", mark.where)
                continue
            positions.append({"at": common_prefix(tokens, full), "ttl": mark.ttl})
        return positions

    async def render(self, scope: Scope, body: dict[str, Any],
                     api: str = "messages") -> list[int] | None:
        """The token ids vLLM's own renderer makes of an Anthropic request (or,
        with ``api="responses"``, of a Responses one), the same as the route
        prefills (remembered by content)."""
        body = copy.deepcopy(body)
        body.pop("kv_transfer_params", None)
        body["stream"] = False
        key = api + hashlib.sha256(dumps(body)).hexdigest()
        if key in self._renders:
            self._renders.move_to_end(key)
            return self._renders[key]
        renderer = getattr(getattr(scope.get("app"), "state", None), "serving_render", None)
        if renderer is None:
            logger.warning("sparkcache: this vLLM server has no renderer; "
                           "cache_control sets no breakpoint")
            return None
        # vLLM's own request model: imported here, where vLLM's server has loaded it,
        # so that the page and the checks load without vLLM.
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        try:
            if api == "responses":
                result = await renderer.render_responses_request(
                    ResponsesRequest.model_validate(body))
            else:
                result = await renderer.render_messages_request(
                    AnthropicMessagesRequest.model_validate(body))
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
