"""``sparkcache serve``: vLLM's OpenAI- and Anthropic-compatible server with snapshots.

:mod:`~sparkcache.serve.launch` starts vLLM's API server with the connector
configured and :class:`~sparkcache.serve.middleware.SparkCacheMiddleware` in
front of it; the middleware turns Anthropic ``cache_control`` blocks into
breakpoints (:mod:`~sparkcache.serve.cache_control`), reports usage in each
API's terms from what the connector did (:mod:`~sparkcache.serve.usage`),
logs every request and serves the ``/sparkcache`` page
(:mod:`~sparkcache.serve.page`).  docs/serve.md describes all of it.

This package's ``__init__`` imports nothing, so that the CLI can import the
launcher without the server's modules.
"""
