"""A contiguous per-layer KV cache: the interface the model writes through.

``update`` stores the new keys/values at their positions and returns everything cached so far. Later
engines swap in a paged, quantized cache with the same method.
"""

import torch

from qinfer.arch import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu"):
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)  # [B, Hkv, S_max, D]
        self.max_len = max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos: [T]; k, v: [B, Hkv, T, D] -> cached [B, Hkv, end, D]
        end = int(input_pos[-1]) + 1
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; position {end - 1} does not fit")
        self.k[layer][:, :, input_pos] = k
        self.v[layer][:, :, input_pos] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
