"""Attention over the KV cache: ``softmax(q k^T * scale + mask) v`` with grouped-query heads.

``attention_ref`` is the plain-torch definition; ``attention`` is the entry point the model calls (today
PyTorch's fused SDPA, which on CPU is a flash-attention style kernel). A mask whose query rows see only a
band of the keys (a sliding window, or a decode step past the window) is run in chunks of ``CHUNK`` query
rows, each against only the keys its rows can see: SDPA with an explicit mask computes every [T, S] product,
where a window of W needs about T * (W + CHUNK).
"""

import torch
import torch.nn.functional as F

CHUNK = 256  # query rows per chunk; 128-256 were fastest at gemma3's shapes (window 512, 1-4k tokens)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [T, S] bool (True = attend); returns [B, H, T, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    T, S = q.shape[2], k.shape[2]
    if T == 1 and bool(mask.all()):
        return _sdpa(q, k, v, None, scale)  # a decode step that sees every cached key needs no mask
    if T == S and bool(mask.equal(torch.ones_like(mask).tril())):
        return _sdpa(q, k, v, None, scale, causal=True)  # SDPA skips the blocks above the diagonal (~15% in fp32)
    spans = _key_spans(mask)
    if spans is None:
        return _sdpa(q, k, v, mask, scale)
    # keys k0:k1 hold every key the rows i0:i1 may see; the mask keeps its meaning inside the slice
    return torch.cat(
        [_sdpa(q[:, :, i0:i1], k[:, :, k0:k1], v[:, :, k0:k1], mask[i0:i1, k0:k1], scale) for i0, i1, k0, k1 in spans],
        dim=2,
    )


def _key_spans(mask: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """(i0, i1, k0, k1) per chunk of query rows, k0:k1 the columns its rows attend; None when chunking would
    not at least halve the products (a full or causal-like mask), or a chunk attends nothing."""
    T, S = mask.shape
    spans = []
    for i0 in range(0, T, CHUNK):
        i1 = min(T, i0 + CHUNK)
        cols = mask[i0:i1].any(dim=0).nonzero()
        if len(cols) == 0:
            return None  # rows that see no key: leave them to SDPA as they are
        spans.append((i0, i1, int(cols[0]), int(cols[-1]) + 1))
    return spans if 2 * sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in spans) <= T * S else None


def _sdpa(q, k, v, mask, scale, causal=False):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
