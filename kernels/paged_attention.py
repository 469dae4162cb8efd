"""Attention over a paged KV cache, and writing keys and values into its pages: the pure-torch references.

The page layout (``qinfer.format``, "The paged KV cache") per layer: ``k_pages`` and ``v_pages`` [N, Hkv, P, D]
(N blocks of P positions; bf16, or int8 / E4M3 codes), and for codes the position scales ``k_pos``, ``v_pos``
[N, Hkv, P] fp32 and the channel scales ``k_scale``, ``v_scale`` [Hkv, D] fp32. A sequence's position p lives in
block ``block_table[p // P]``, row ``p % P``; its key is ``k_pages[b, h, r] * k_scale[h] * k_pos[b, h, r]``.

``write_pages`` quantizes a chunk of new keys and values on the way in (each position's scale from its own range,
so a position's codes depend on it alone): the cache writes through it on CPU, and it is the Triton write's
reference. ``paged_decode_ref`` attends one query per sequence over its pages (sequences of different lengths,
grouped-query heads, a sliding window); ``paged_prefill_ref`` writes a chunk's keys and values into its
sequence's pages and attends its queries over them, causally. The Triton kernels
(``qinfer.kernels.triton_attention``) take the same arguments. Every product and sum is fp32 and the output is
rounded once to the queries' dtype.
"""

import torch

from qinfer.format import e4m3_times

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest code of each page dtype


def quantize_rows(x: torch.Tensor, channel_scale: torch.Tensor, code_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Hkv, D] -> (codes [..., Hkv, D] in ``code_dtype``, position scales [..., Hkv] fp32) with
    ``x ≈ codes * channel_scale * pos``: ``pos = max_d |x_d / c_d| / QMAX``, so the largest code is QMAX and
    nothing clips; int8 rounds to nearest, E4M3 by the cast."""
    y = x.float() / channel_scale
    pos = y.abs().amax(dim=-1).clamp_min_(1e-30).div_(QMAX[code_dtype])  # (an all-zero position: codes 0)
    y = y.div_(pos[..., None])
    return (y.round_() if code_dtype == torch.int8 else y).to(code_dtype), pos


def write_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> None:
    """Store k, v [T, Hkv, D] at ``slots`` [T] (``block * P + row``) of the pages, quantized where the pages hold
    codes (then the scales are needed: channel ``k_scale``, ``v_scale`` [Hkv, D]; position ``k_pos``, ``v_pos``
    [N, Hkv, P], written here)."""
    N, Hkv, P, D = k_pages.shape
    block, row = slots // P, slots % P
    for pages, x, c, pos in ((k_pages, k, k_scale, k_pos), (v_pages, v, v_scale, v_pos)):
        if pages.dtype in QMAX:
            codes, t = quantize_rows(x, c, pages.dtype)
            pages[block, :, row] = codes
            pos[block, :, row] = t
        else:
            pages[block, :, row] = x.to(pages.dtype)


def gather_pages(pages: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``positions`` [S] of every sequence, as stored: pages [N, Hkv, P, D] -> [B, Hkv, S, D] (position scales
    [N, Hkv, P] -> [B, Hkv, S]), through ``block_tables`` [B, M]."""
    P = pages.shape[2]
    return pages[block_tables[:, positions // P].long(), :, positions % P].transpose(1, 2)


def gather_ref(pages: torch.Tensor, block_table: torch.Tensor, start: int, end: int,
               channel_scale: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Positions start..end-1 of one sequence, [Hkv, end - start, D] fp32, dequantized where the pages hold codes."""
    positions = torch.arange(start, end, device=pages.device)
    x = gather_pages(pages, block_table[None], positions)[0]  # [Hkv, S, D] as stored
    if pages.dtype in QMAX:
        scale = channel_scale[:, None, :] * gather_pages(pos, block_table[None], positions)[0][..., None]
        x = e4m3_times(x, scale) if pages.dtype == torch.float8_e4m3fn else x.float() * scale
    return x.float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    # q [T, H, D]; k, v [Hkv, S, D] fp32; mask [T, S] (True = attend) -> [T, H, D] fp32
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, S, D]
    scores = (q.float().transpose(0, 1) @ k.transpose(-1, -2)) * scale  # [H, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


def paged_decode_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D], the query of sequence b at position ``seq_lens[b] - 1`` (its own key
    already written), against that sequence's positions ``max(0, seq_lens[b] - window)`` to ``seq_lens[b] - 1``
    through ``block_tables`` [B, max_blocks] (entries past a sequence's blocks are ignored). -> [B, H, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        start = 0 if window is None else max(0, n - window)
        k = gather_ref(k_pages, block_tables[b], start, n, k_scale, k_pos)
        v = gather_ref(v_pages, block_tables[b], start, n, v_scale, v_pos)
        out[b] = _attend(q[b][None], k, v, None, scale)[0].to(q.dtype)
    return out


def paged_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      block_table: torch.Tensor, start: int, scale: float, window: int | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of T positions start..start+T-1 of one sequence: its keys and values k, v [T, Hkv, D] are written
    into the pages (its blocks reserved in ``block_table``), then its queries q [T, H, D] attend over positions
    0..start+T-1 causally (and within ``window``). -> [T, H, D]."""
    T = q.shape[0]
    end = start + T
    positions = torch.arange(start, end, device=q.device)
    P = k_pages.shape[2]
    slots = block_table[positions // P].long() * P + positions % P
    write_pages(k_pages, v_pages, slots, k, v, k_scale, v_scale, k_pos, v_pos)
    first = 0 if window is None else max(0, start - window + 1)  # the first key any of the queries sees
    keys = gather_ref(k_pages, block_table, first, end, k_scale, k_pos)
    values = gather_ref(v_pages, block_table, first, end, v_scale, v_pos)
    q_at = positions[:, None]
    k_at = torch.arange(first, end, device=q.device)[None, :]
    mask = k_at <= q_at
    if window is not None:
        mask &= k_at > q_at - window
    return _attend(q, keys, values, mask, scale).to(q.dtype)
