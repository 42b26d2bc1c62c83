"""Moving pages between KV-cache tensors and host buffers.  Not implemented yet: see issue 4."""
