"""Moving KV pages between vLLM's cache tensors (CPU or GPU) and host memory.

See :mod:`sparkcache.cuda.pages` and :mod:`sparkcache.cuda.staging`.
Importing this package does not import torch; the first :class:`KVPages` does.
"""

from sparkcache.cuda.pages import KVPages, block_runs, byte_pages, ordered_layers
from sparkcache.cuda.staging import CopyStream, StagedRestore, StagingPool

__all__ = ["CopyStream", "KVPages", "StagedRestore", "StagingPool", "block_runs", "byte_pages",
           "ordered_layers"]
