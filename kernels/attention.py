"""Attention over the KV cache: ``softmax(q k^T * scale + mask) v`` with grouped-query heads.

``attention_ref`` is the plain-torch definition; ``attention`` is the entry point the model calls (today
PyTorch's fused SDPA, which on CPU is a flash-attention style kernel).
"""

import torch
import torch.nn.functional as F


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [T, S] bool (True = attend); returns [B, H, T, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    T, S = q.shape[2], k.shape[2]
    causal = False
    if T == 1 and bool(mask.all()):
        mask = None  # a decode step that sees every cached key needs no mask; SDPA then skips it
    elif T == S and bool(mask.equal(torch.ones_like(mask).tril())):
        mask, causal = None, True  # a plain causal mask: SDPA skips the blocks above the diagonal (~15% in fp32)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
