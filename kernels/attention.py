"""Attention over the KV cache: ``softmax(q k^T * scale + mask) v`` with grouped-query heads.

``attention_ref`` is the plain-torch definition; ``attention`` is the entry point the model calls (today
PyTorch's fused SDPA, which on CPU is a flash-attention style kernel). A quantized KV cache hands over its int8
or E4M3 codes and their scales (per KV head and channel, and per position and KV head): a decode step's C loop
(below) reads the codes, other steps attend over ``dequantize_kv`` of the slice. A mask whose query rows see
only a band of the keys (a sliding window, or a decode step past the window) is run in chunks of ``CHUNK`` query
rows, each against only the keys its rows can see: SDPA with an explicit mask computes every [T, S] product,
where a window of W needs about T * (W + CHUNK). A decode step (one query row, every key visible: the model
passes no mask, having handed the step only the keys it sees) runs as two fp32 matmuls over the query heads
grouped by KV head: SDPA's flash kernel is built for many query rows and is slower for one. On CPU, eagerly,
that step goes to ``attention_cpu``'s C loop instead: the same fp32 sums, split over chunks of keys, each key and
value row read once for the query heads that share it, no fp32 copies. How the three compare at gemma3-270m's
shape, in a loop and inside decode steps (where the keys come from memory), was timed ad hoc: docs/results.md,
"Speed against the roofline" and "Figures formerly in code comments".
"""

import torch
import torch.nn.functional as F

from qinfer.format import e4m3_times
from qinfer.kernels import attention_cpu
from qinfer.kernels.paged_attention import gather_pages

CHUNK = 256  # query rows per chunk; 128-256 were fastest at gemma3's shapes (window 512, 1-4k tokens)
# Largest K slice (elements) a decode step converts to fp32; past it (gemma3's 32k-token cache) the fp32
# copies of K and V cost more than SDPA saves.
DECODE_MATMUL_MAX = 1 << 22


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    # q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [T, S] bool (True = attend), None = all; returns [B, H, T, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  pos: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized KV cache's int8 or E4M3 ``codes`` [B, Hkv, S, D] times their ``scale`` (fp32 products), in
    ``dtype``: [Hkv, D], one per KV head and channel, or [Hkv], one per head; and times ``pos`` [B, Hkv, S], one
    per position and KV head, if given."""
    scale = scale.reshape(1, codes.shape[1], 1, -1)  # [1, Hkv, 1, D or 1]
    if pos is not None:
        scale = scale * pos[..., None]  # [B, Hkv, S, D or 1]
    if codes.dtype == torch.float8_e4m3fn:  # the same numbers as codes.float() * scale, without float8's slow cast
        return e4m3_times(codes, scale).to(dtype)
    return (codes.float() * scale).to(dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    kv_scales: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    # mask None: every query sees every key. kv_scales: k and v are a quantized cache's codes, and these their
    # scales (k_scale, v_scale[, k_pos, v_pos]): [Hkv, D] (per KV head and channel) or [Hkv] each, and [B, Hkv, S]
    # (per position and KV head)
    T, S = q.shape[2], k.shape[2]
    if kv_scales is not None:
        k_scale, v_scale, k_pos, v_pos = (*kv_scales, None, None)[:4]
        if T == 1 and (mask is None or bool(mask.all())) and attention_cpu.attention_supported(q, k, v, quantized=True):
            return attention_cpu.decode_attention(q, k, v, scale, k_scale, v_scale, k_pos, v_pos)  # scales folded in
        k, v = dequantize_kv(k, k_scale, q.dtype, k_pos), dequantize_kv(v, v_scale, q.dtype, v_pos)
    if mask is None and T > 1:
        return _sdpa(q, k, v, None, scale)
    if T == 1 and (mask is None or bool(mask.all())):  # a decode step that sees every cached key needs no mask
        if attention_cpu.attention_supported(q, k, v):
            return attention_cpu.decode_attention(q, k, v, scale)
        return _decode(q, k, v, scale) if k.numel() <= DECODE_MATMUL_MAX else _sdpa(q, k, v, None, scale)
    if T == S and _is_causal(mask):
        return _sdpa(q, k, v, None, scale, causal=True)  # SDPA skips the blocks above the diagonal
    spans = _key_spans(mask)
    if spans is None:
        return _sdpa(q, k, v, mask, scale)
    # keys k0:k1 hold every key the rows i0:i1 may see; the mask keeps its meaning inside the slice
    return torch.cat(
        [_sdpa(q[:, :, i0:i1], k[:, :, k0:k1], v[:, :, k0:k1], mask[i0:i1, k0:k1], scale) for i0, i1, k0, k1 in spans],
        dim=2,
    )


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                 start: int | torch.Tensor, end: int | torch.Tensor, scale: float,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """A decode step over a paged KV cache: q [B, H, 1, D], one query row per sequence, against positions
    start..end-1 of each sequence's pages [N, Hkv, P, D] through ``block_tables`` [B, M]; ``start`` and ``end``
    are ints (every sequence the same range) or [B] int64 tensors (a range per sequence); ``kv_scales``: the
    pages hold codes, and these are (k_scale, v_scale [Hkv, D], k_pos, v_pos [N, Hkv, P]). On CPU, eagerly, the C
    loop reads the pages in place; elsewhere each range of positions is gathered into a slice for
    :func:`attention` (one call for a shared range, one per sequence otherwise)."""
    k_scale, v_scale, k_pos, v_pos = kv_scales or (None,) * 4
    B = q.shape[0]
    if attention_cpu.paged_supported(q, k_pages, v_pages, quantized=kv_scales is not None):
        starts, ends = (x if isinstance(x, torch.Tensor) else torch.full((B,), x, dtype=torch.int64)
                        for x in (start, end))
        return attention_cpu.paged_decode_attention(q, k_pages, v_pages, block_tables, starts, ends, scale,
                                                    k_scale, v_scale, k_pos, v_pos)
    if isinstance(start, torch.Tensor) or isinstance(end, torch.Tensor):
        starts, ends = (x.tolist() if isinstance(x, torch.Tensor) else [x] * B for x in (start, end))
        return torch.cat([paged_decode(q[b:b + 1], k_pages, v_pages, block_tables[b:b + 1], starts[b], ends[b],
                                       scale, kv_scales) for b in range(B)])
    positions = torch.arange(start, end, device=q.device)
    k, v = gather_pages(k_pages, block_tables, positions), gather_pages(v_pages, block_tables, positions)
    if kv_scales is not None:
        kv_scales = (k_scale, v_scale, gather_pages(k_pos, block_tables, positions),
                     gather_pages(v_pos, block_tables, positions))
    return attention(q, k, v, None, scale, kv_scales)


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


def _is_causal(mask: torch.Tensor, rows: int = 1024) -> bool:
    # mask: [T, T]; compared against the lower triangle a block of rows at a time (a whole [T, T] triangle
    # would be one more 1 GiB tensor at 32k tokens)
    T = mask.shape[0]
    return all(
        mask[i : i + rows].equal(torch.ones(min(rows, T - i), T, dtype=torch.bool, device=mask.device).tril(i))
        for i in range(0, T, rows)
    )


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, H, 1, D]; k, v: [B, Hkv, S, D]. Query head h reads KV head h // (H / Hkv), so the heads of one
    # KV head are consecutive and become the rows of one matmul: no copy of K or V per query head.
    B, H, T, D = q.shape
    scores = q.reshape(B, k.shape[1], H // k.shape[1] * T, D).float() @ k.float().transpose(-1, -2) * scale
    return (scores.softmax(dim=-1) @ v.float()).view(B, H, T, D).to(q.dtype)


def _sdpa(q, k, v, mask, scale, causal=False):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
