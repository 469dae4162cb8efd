"""Triton attention over the paged KV cache: the GPU path of ``qinfer.kernels.paged_attention``'s references.

The pages are those of ``qinfer.format`` ("The paged KV cache"): [N, Hkv, P, D] bf16, int8 or E4M3 codes, with
fp32 position scales [N, Hkv, P] and channel scales [Hkv, D] for codes. Each kernel finds a position's row
through the block table (``block = table[p // P]``, row ``p % P``), so any block size works, and dequantizes
codes in registers: ``x = code * c[h, d] * t[block, h, row]``. E4M3 codes are read as bytes and their bits moved
into fp16, as ``triton_matmul`` does (exact; no native float8 conversion, which GPUs before Ada lack).

- ``paged_decode``: one query row per sequence (the newest position, its key already written), split-KV as
  flash-decoding: the grid is (sequence, KV head, split of the positions); a program keeps, for the query heads
  that share its KV head, the running max, the sum of exponentials and the weighted sum of values over its
  split (the online softmax), and a second kernel combines the splits exactly. Long contexts thus spread over
  many programs while a batch of short ones still fills the grid.
- ``paged_prefill``: a chunk of T new positions of one sequence. The chunk's keys and values are written into
  its pages first (quantized on the way in, a program per position and KV head: each position's scale from its
  own range), then causal flash attention over positions ``max(0, start - window + 1)..start + T - 1``: the grid
  is (tile of queries, query head), key tiles visited in order with the online softmax.

Every product and sum is fp32 and the output is rounded once to the queries' dtype, as the references do; block
sizes are fixed (autotuning several configurations needs a GPU driver, which this project's machines lack).
No GPU has run these: the tests check them against the references in Triton's interpreter on CPU
(``TRITON_INTERPRET=1``) and compile them for Hopper. :func:`decode_cost` and :func:`prefill_cost` count the
bytes a kernel must move and the FLOPs it must do, from which ``qinfer.evals.diagnostics.attention_bench``
projects GPU times.
"""

import torch
import triton
import triton.language as tl

CODES = {torch.bfloat16: 0, torch.float16: 0, torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2}
QMAX = {1: 127.0, 2: 448.0}
SPLIT = 256  # positions per decode program: split-KV over long contexts
BLOCK_N = 16  # key positions per tile
BLOCK_M = 16  # query rows per prefill program


@triton.jit
def _load_rows(ptr, off, d, mask, CODE: tl.constexpr):
    """Rows at element offsets ``off`` [N] of the pages, columns ``d`` [D], as fp32 (codes not yet scaled)."""
    if CODE == 2:  # E4M3 bytes -> fp16 bits (value / 2^8), exact
        c = tl.load(ptr.to(tl.pointer_type(tl.uint8)) + off[:, None] + d[None, :], mask=mask[:, None], other=0)
        c = c.to(tl.int32)
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * 256.0
    return tl.load(ptr + off[:, None] + d[None, :], mask=mask[:, None], other=0).to(tl.float32)


@triton.jit
def _page_rows(bt_ptr, j, inside, g, Hkv, P):
    """The rows of positions ``j`` (KV head g) in the pages, through the block table at ``bt_ptr``."""
    blk = tl.load(bt_ptr + j // P, mask=inside, other=0).to(tl.int64)
    return (blk * Hkv + g) * P + j % P


@triton.jit
def _softmax_step(m, total, scores):
    """The online softmax over one more tile of ``scores`` [rows, keys] (-inf where a key is not seen): the new
    running max, the factor that rescales what was summed so far, this tile's weights, and the new sum of weights.
    A row that has seen no key yet keeps max -inf and weights 0."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - safe)
    p = tl.exp(scores - safe[:, None])
    return m_new, alpha, p, total * alpha + tl.sum(p, axis=1)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kp_ptr, vp_ptr, bt_ptr, len_ptr, o_ptr, m_ptr, l_ptr,
                   scale, Hkv, P, stride_qb, stride_qh, stride_bt, window, SPLITS,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, CODE: tl.constexpr,
                   WINDOW: tl.constexpr, BLOCK: tl.constexpr, SPLIT_LEN: tl.constexpr):
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(len_ptr + b)
    lo = tl.maximum(n - window, 0) if WINDOW else 0
    s_lo = lo + s * SPLIT_LEN
    s_hi = tl.minimum(s_lo + SPLIT_LEN, n)
    i, d = tl.arange(0, GP), tl.arange(0, D)
    heads = g * G + i  # the query heads of KV head g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(i < G)[:, None], other=0)
    q = q.to(tl.float32)
    if CODE != 0:  # (q . (k c)) = ((q c) . k): the channel scales once on the queries
        q = q * tl.load(ks_ptr + g * D + d)[None, :]
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for j0 in range(s_lo, s_hi, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inside = j < s_hi
        row = _page_rows(bt_ptr + b * stride_bt, j, inside, g, Hkv, P)  # [BLOCK]
        k = _load_rows(k_ptr, row * D, d, inside, CODE)  # [BLOCK, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK]
        if CODE != 0:
            scores = scores * tl.load(kp_ptr + row, mask=inside, other=0)[None, :]
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new, alpha, p, total = _softmax_step(m, total, scores)
        if CODE != 0:  # value j's position scale joins its weight after the sum: the denominator is the keys'
            p = p * tl.load(vp_ptr + row, mask=inside, other=0)[None, :]
        v = _load_rows(v_ptr, row * D, d, inside, CODE)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if CODE != 0:
        acc = acc * tl.load(vs_ptr + g * D + d)[None, :]
    at = (b * Hkv * G + heads) * SPLITS + s  # [GP] partials of (b, head, split)
    tl.store(o_ptr + at[:, None] * D + d[None, :], acc, mask=(i < G)[:, None])
    tl.store(m_ptr + at, m, mask=i < G)
    tl.store(l_ptr + at, total, mask=i < G)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, H, SPLITS,
                    D: tl.constexpr, SP: tl.constexpr):
    """out[b, h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the splits, M the largest m_s."""
    b, h = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SP), tl.arange(0, D)
    at = (b * H + h) * SPLITS + s
    m = tl.load(m_ptr + at, mask=s < SPLITS, other=float("-inf"))
    big = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))  # an empty split weighs nothing
    total = tl.sum(w * tl.load(l_ptr + at, mask=s < SPLITS, other=0), axis=0)
    acc = tl.load(o_ptr + at[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None], other=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out)


@triton.jit
def _write_kernel(x_ptr, pages_ptr, c_ptr, pos_ptr, bt_ptr, start, Hkv, P, stride_xt, stride_xh,
                  D: tl.constexpr, CODE: tl.constexpr, QMAX: tl.constexpr):
    """Position start + t, KV head h of x [T, Hkv, D] into its page row, quantized where the pages hold codes."""
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    p = start + t
    blk = tl.load(bt_ptr + p // P).to(tl.int64)
    row = (blk * Hkv + h) * P + p % P
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d).to(tl.float32)
    if CODE == 0:
        tl.store(pages_ptr + row * D + d, x.to(pages_ptr.dtype.element_ty))
    else:
        y = x / tl.load(c_ptr + h * D + d)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30) / QMAX  # this position's own range: nothing clips
        y = y / scale
        if CODE == 1:
            tl.store(pages_ptr + row * D + d, _round_half_even(y).to(tl.int8))
        else:
            tl.store(pages_ptr.to(tl.pointer_type(tl.uint8)) + row * D + d, _e4m3_bits(y))
        tl.store(pos_ptr + row, scale)


@triton.jit
def _round_half_even(y):
    """Round to nearest, ties to even, as ``torch.round`` does."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _e4m3_bits(y):
    """The E4M3 (fn) byte nearest to ``y`` (|y| <= 448), ties to even, as ``Tensor.to(torch.float8_e4m3fn)``."""
    a = tl.abs(y)
    sign = ((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7  # the sign bit, -0.0's too
    # the exponent of a's binade (2^-6 for subnormals), and its step: 3 mantissa bits
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
    step = tl.exp2(e - 3.0)
    q = _round_half_even(a / step) * step  # a on the grid of its binade (may round up into the next)
    e2 = tl.maximum(tl.floor(tl.log2(tl.maximum(q, 1e-30))), -6.0)
    normal = q >= 0.015625  # 2^-6
    mant = tl.where(normal, q / tl.exp2(e2) * 8.0 - 8.0, q / 0.001953125)  # subnormal step 2^-9
    expo = tl.where(normal, e2 + 7.0, 0.0)
    bits = (expo.to(tl.int32) << 3) | mant.to(tl.int32)
    bits = tl.where(q == 0.0, 0, bits)
    return (bits | sign).to(tl.uint8)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kp_ptr, vp_ptr, bt_ptr, out_ptr, start, T, scale,
                    Hkv, P, stride_qt, stride_qh, stride_ot, stride_oh, window,
                    G: tl.constexpr, D: tl.constexpr, CODE: tl.constexpr, WINDOW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1)
    g = h // G
    t = tile * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    q_at = start + t  # the queries' positions
    rows = t < T
    q = tl.load(q_ptr + t[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rows[:, None], other=0)
    q = q.to(tl.float32)
    if CODE != 0:
        q = q * tl.load(ks_ptr + g * D + d)[None, :]
    last = tl.minimum(start + tile * BM + BM, start + T)  # one past the last key any of the rows sees
    first = tl.maximum(start + tile * BM - window + 1, 0) if WINDOW else 0
    m = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for j0 in range(first, last, BN):
        j = j0 + tl.arange(0, BN)
        inside = j < last
        row = _page_rows(bt_ptr, j, inside, g, Hkv, P)
        k = _load_rows(k_ptr, row * D, d, inside, CODE)  # [BN, D]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BM, BN]
        if CODE != 0:
            scores = scores * tl.load(kp_ptr + row, mask=inside, other=0)[None, :]
        seen = inside[None, :] & (j[None, :] <= q_at[:, None])
        if WINDOW:
            seen = seen & (j[None, :] > q_at[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new, alpha, p, total = _softmax_step(m, total, scores)  # (padding rows see no key)
        if CODE != 0:
            p = p * tl.load(vp_ptr + row, mask=inside, other=0)[None, :]
        v = _load_rows(v_ptr, row * D, d, inside, CODE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    if CODE != 0:
        acc = acc * tl.load(vs_ptr + g * D + d)[None, :]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d[None, :], out, mask=rows[:, None])


def _scales(k_pages, k_scale, v_scale, k_pos, v_pos):
    """The kernels' scale pointers: the real ones for codes, else any tensor (never read)."""
    if CODES[k_pages.dtype] == 0:
        return (k_pages,) * 4
    return tuple(x.float().contiguous() for x in (k_scale, v_scale, k_pos, v_pos))


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention.paged_decode_ref`` on the GPU: q [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    N, Hkv, P, _ = k_pages.shape
    G = H // Hkv
    code = CODES[k_pages.dtype]
    k_scale, v_scale, k_pos, v_pos = _scales(k_pages, k_scale, v_scale, k_pos, v_pos)
    longest = int(seq_lens.max()) if window is None else min(int(seq_lens.max()), window)
    splits = max(1, triton.cdiv(longest, SPLIT))
    part_o = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    part_m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    kp, vp = (x.contiguous().view(torch.uint8) if code == 2 else x.contiguous() for x in (k_pages, v_pages))
    _decode_kernel[(B, Hkv, splits)](
        q, kp, vp, k_scale, v_scale, k_pos, v_pos, tables, lens, part_o, part_m, part_l, scale, Hkv, P,
        q.stride(0), q.stride(1), tables.stride(0), window or 0, splits,
        G=G, GP=max(2, triton.next_power_of_2(G)), D=D, CODE=code, WINDOW=window is not None, BLOCK=BLOCK_N,
        SPLIT_LEN=SPLIT)
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)  # (rounded once, below)
    _combine_kernel[(B, H)](part_o, part_m, part_l, out, out.stride(0), out.stride(1), H, splits, D=D,
                            SP=max(2, triton.next_power_of_2(splits)))
    return out.to(q.dtype)


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                  block_table: torch.Tensor, start: int, scale: float, window: int | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention.paged_prefill_ref`` on the GPU: writes k, v [T, Hkv, D] at positions start.. of the
    sequence's pages, then q [T, H, D] attends causally -> [T, H, D]."""
    T, H, D = q.shape
    N, Hkv, P, _ = k_pages.shape
    code = CODES[k_pages.dtype]
    table = block_table.to(torch.int32).contiguous()
    for x, pages, c, pos in ((k, k_pages, k_scale, k_pos), (v, v_pages, v_scale, v_pos)):
        target = pages.view(torch.uint8) if code == 2 else pages
        c = pages if code == 0 else c.float().contiguous()
        _write_kernel[(T, Hkv)](x, target, c, pages if pos is None else pos, table, start, Hkv, P, x.stride(0),
                                x.stride(1), D=D, CODE=code, QMAX=QMAX.get(code, 1.0))
    k_scale, v_scale, k_pos, v_pos = _scales(k_pages, k_scale, v_scale, k_pos, v_pos)
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)  # (rounded once, below)
    kp, vp = (x.view(torch.uint8) if code == 2 else x for x in (k_pages, v_pages))
    _prefill_kernel[(triton.cdiv(T, BLOCK_M), H)](
        q, kp, vp, k_scale, v_scale, k_pos, v_pos, table, out, start, T, scale, Hkv, P, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), window or 0, G=H // Hkv, D=D, CODE=code, WINDOW=window is not None,
        BM=BLOCK_M, BN=BLOCK_N)
    return out.to(q.dtype)


def decode_cost(lengths: list[int], H: int, Hkv: int, D: int, kv_bytes: int, window: int | None = None
                ) -> tuple[int, int]:
    """(bytes, FLOPs) a decode step over sequences of ``lengths`` must move and do: every key and value it attends
    read once (``kv_bytes`` per element; codes add an fp32 position scale per row), the queries read and the
    outputs written in bf16; 4 FLOPs per query head, position and channel (q.k and p.v, multiply and add)."""
    seen = sum(min(n, window) if window else n for n in lengths)
    row = D * kv_bytes + (4 if kv_bytes == 1 else 0)
    return 2 * seen * Hkv * row + 2 * 2 * len(lengths) * H * D, 4 * seen * H * D


def prefill_cost(start: int, T: int, H: int, Hkv: int, D: int, kv_bytes: int, window: int | None = None
                 ) -> tuple[int, int]:
    """(bytes, FLOPs) of a prefill chunk of T positions after ``start``: the chunk's keys and values written,
    every key and value it sees read once per tile of queries, the queries read and outputs written in bf16;
    4 FLOPs per query head, (query, visible key) pair and channel."""
    pairs = sum(min(start + t + 1, window) if window else start + t + 1 for t in range(T))
    keys = min(start + T, (window or start + T) + T)
    row = D * kv_bytes + (4 if kv_bytes == 1 else 0)
    reads = 2 * keys * Hkv * row * triton.cdiv(T, BLOCK_M) * (H // Hkv)
    return reads + 2 * T * Hkv * row + 2 * 2 * T * H * D, 4 * pairs * H * D
