"""The vLLM KV connector (scheduler and worker sides).  Not implemented yet: see issue 4."""
