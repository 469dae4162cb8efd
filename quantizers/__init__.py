"""Quantizers: pure functions over tensors (RTN, GPTQ, AWQ, FP8, KV-cache scales)."""
