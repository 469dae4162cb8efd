"""The model: the architecture table, the decoder with explicit prefill and decode steps, its KV cache, and
loading a folder into it."""
