"""Moving KV pages between vLLM's cache tensors (CPU or GPU) and host memory.

See :mod:`sparkcache.cuda.pages`.  Importing this package does not import
torch; the first :class:`KVPages` does.
"""

from sparkcache.cuda.pages import KVPages, block_runs, byte_pages, ordered_layers

__all__ = ["KVPages", "block_runs", "byte_pages", "ordered_layers"]
