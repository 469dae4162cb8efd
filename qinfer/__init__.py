"""qinfer: quantization-first low-bit LLM inference."""

__version__ = "0.1.0"
