"""Bytes and FLOPs of one prefill or decode step, counted from the tensors a loaded model actually holds.

Bytes read by one decode step at batch 1 and context ``S`` (positions already cached):

- every ``QLinear`` of the blocks: its stored weight as loaded (a dense tensor, or a packed weight's
  ``.tensors()``: codes, scales, zeros), plus its bias;
- the lm_head's weight in full (for a tied model that is the embedding matrix, read by the matmul);
- one embedding row, and every RMSNorm weight;
- the KV cache: the cached positions each layer reads, keys and values, at the cache's own bytes per
  position (``KVCache.bytes_per_token``: bf16, or int8/fp8 codes and a scale per position) plus its channel
  scales: all ``S`` in a full-attention layer, the ``window - 1`` newest in a sliding-window layer (the step's
  own key and value make its window; the model asks the cache for nothing older).

FLOPs are model FLOPs, the useful work (the MFU convention): ``2 * in * out`` per linear per token, and
attention ``4 * H * D`` per (query, visible key) pair, where a sliding-window layer sees at most
``window`` keys. Prefill runs the lm_head on the last position only (``generate.prefill``).
Bytes of a prefill: each weight once, ``T`` embedding rows, and the KV cache it writes.

:func:`prefill_flops_by_dtype` splits a prefill's FLOPs by the dtype they multiply in, which MFU takes its
ceilings from: a linear's from the kernel its rows go to (``QLinear.matmul_dtype``: the CPU int4 kernel,
which takes fewer than ``qinfer.kernels.int4_cpu.max_rows`` rows, 32 where the GEMMs run in bf16 or fp16 and
128 where they run in fp32, multiplies in fp32, a dense or dequantize-then-matmul linear in the
activations' dtype, or in fp32 on a CPU without native bf16 GEMMs), attention's in the dtype a dense product
of the prompt's rows takes (``qinfer.kernels.dense.product_dtype``: on such a CPU, SDPA in bf16 runs at its
fp32 speed, not at the far slower bf16 GEMM peak; docs/results.md, "Speed against the roofline" and "Figures
formerly in code comments").
"""

from collections import Counter

import torch

from qinfer.kernels.dense import product_dtype
from qinfer.model.kv_cache import KVCache
from qinfer.model.decoder import QLinear, RMSNorm, Transformer


def weight_bytes(weight) -> int:
    """Bytes of a dense weight tensor or of a packed weight's stored tensors."""
    if hasattr(weight, "tensors"):
        return sum(t.numel() * t.element_size() for t in weight.tensors("w").values())
    return weight.numel() * weight.element_size()


def _linear_bytes(module: QLinear) -> int:
    bias = 0 if module.bias is None else module.bias.numel() * module.bias.element_size()
    return weight_bytes(module.weight) + bias


def _weights_bytes(model: Transformer) -> int:
    """All linears (lm_head included) and norms: what every forward reads once."""
    linears = sum(_linear_bytes(m) for m in model.modules() if isinstance(m, QLinear))
    norms = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, RMSNorm))
    return linears + norms


def _embedding_row_bytes(model: Transformer) -> int:
    emb = model.model.embed_tokens.weight  # a dense table, or a quantized lm_head's packed rows
    return weight_bytes(emb) // emb.shape[0]


def kv_bytes(cache: KVCache, positions: int) -> int:
    """Bytes of ``positions`` cached positions over all layers, keys and values, with their scales."""
    scales = sum(t.numel() * t.element_size() for pair in cache.scales.values() for t in pair)
    return cache.bytes_per_token() * positions + scales


def decode_bytes(model: Transformer, cache: KVCache, context: int) -> int:
    """Bytes one decode step reads at batch 1 with ``context`` positions cached."""
    windows = model.config.sliding_window
    read = sum(context if w is None else min(context, w - 1) for w in windows)  # positions over all layers
    kv = kv_bytes(cache, 0) + cache.bytes_per_token() * read // len(windows)
    return _weights_bytes(model) + _embedding_row_bytes(model) + kv


def prefill_bytes(model: Transformer, cache: KVCache, tokens: int) -> int:
    """Bytes a prefill of ``tokens`` moves: weights once, the embedding rows, the KV cache it writes."""
    return _weights_bytes(model) + tokens * _embedding_row_bytes(model) + kv_bytes(cache, tokens)


def _linear_flops_per_token(model: Transformer) -> tuple[int, int]:
    """(2 * in * out summed over the blocks' linears, the same for the lm_head)."""
    blocks = sum(2 * m.in_features * m.out_features for m in model.model.layers.modules() if isinstance(m, QLinear))
    head = 2 * model.lm_head.in_features * model.lm_head.out_features
    return blocks, head


def _attention_flops(model: Transformer, queries: range) -> int:
    """Attention FLOPs of the queries at absolute ``queries`` positions, each seeing keys 0..itself."""
    c = model.config
    total = 0
    for window in c.sliding_window:
        if window is None:
            pairs = sum(q + 1 for q in queries)
        else:
            pairs = sum(min(q + 1, window) for q in queries)
        total += 4 * c.num_heads * c.head_dim * pairs  # q k^T and p v: 2 FLOP per multiply-add each
    return total


def prefill_flops(model: Transformer, tokens: int) -> int:
    blocks, head = _linear_flops_per_token(model)
    return blocks * tokens + head + _attention_flops(model, range(tokens))


def prefill_flops_by_dtype(model: Transformer, tokens: int) -> dict[torch.dtype, int]:
    """:func:`prefill_flops` split by the dtype each FLOP multiplies in; the values sum to it."""
    flops = Counter({product_dtype(model.dtype, model.device, tokens): _attention_flops(model, range(tokens))})
    for m in model.model.layers.modules():
        if isinstance(m, QLinear):
            flops[m.matmul_dtype(model.dtype, model.device, tokens)] += 2 * m.in_features * m.out_features * tokens
    head = model.lm_head  # the last position only
    flops[head.matmul_dtype(model.dtype, model.device, 1)] += 2 * head.in_features * head.out_features
    return dict(flops)


def decode_flops(model: Transformer, context: int) -> int:
    """FLOPs of the decode step at position ``context`` (``context`` positions already cached)."""
    blocks, head = _linear_flops_per_token(model)
    return blocks + head + _attention_flops(model, range(context, context + 1))
