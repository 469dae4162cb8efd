"""A decode step's attention in C on an x86-64 CPU (``qinfer_decode_attention`` and
``qinfer_paged_decode_attention`` in ``gemv_cpu.c``, built and loaded by ``cpu_library``): one query row per head
over a KV cache's slice, or over each sequence's pages through its block table.

At one query row, PyTorch's paths (SDPA's flash kernel, built for many rows, or two fp32 matmuls per KV head over
fp32 copies of the keys and values; ``qinfer.kernels.attention``) spend more on dispatch and copies than on the
arithmetic (timings in docs/results.md, "Speed against the roofline"). The C loop computes
``softmax(q k^T * scale) v`` in fp32, split across threads over chunks of keys, each key and value row read once,
as stored, for the query heads that share it, and rounds each output once to q's dtype. A quantized cache's int8
or E4M3 codes are read as stored: the per-channel scales are folded into the queries and the weighted sums, the
per-position scales into the scores and the weights, never into a copy of the keys or values. Eager calls only,
outside ``cpu_library.only_gemvs`` (a compiled graph fuses these ops itself); under the profiler the call is the
operator ``torch.ops.qinfer.decode_attention`` (``paged_decode_attention``), so ``decode_profile`` names it;
other calls skip its dispatch. Over pages the loop is the same, each row's address read from the block table: where
every sequence attends the same range of positions, its sums are those over a slice holding the same keys.

Int8 codes with bf16 or fp16 queries, on a CPU with AVX512-VNNI, take integer loops instead
(``cpu_library.attention_loop``; ``attention_without_vnni`` turns them off, ``with_attention_loop`` picks one):
each query head in 15-bit fixed point times the codes widened to 16 bits (VPDPWSSD, exact int32 sums); then the
softmax weights (times the values' position scales) in 15-bit fixed point with a step per block of 16 positions,
against two positions' value codes interleaved in each 32-bit lane (VPDPWSSD again), each block's int32 sums added
to fp32 ones times its step. The scores then differ from the fp32 loop's by about 1e-5 of their range (the
queries' fixed-point step) and the weighted sums by at most 2^-12 of the values' range (the weights' steps), where
the fp32 loop's are exact to fp32 rounding; the fp32 loop does 4 FMAs per query head, position and channel on
one-byte codes, which binds a small CPU before its memory does (docs/results.md, "Paged decode attention").
"""

import torch
from torch.autograd import profiler

from qinfer.kernels import cpu_library
from qinfer.kernels.cpu_library import DTYPE_CODES, KV_CODES, OPS


def attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quantized: bool = False) -> bool:
    """A decode step's attention (``qinfer.kernels.attention``): one query row per head, q [B, H, 1, D] against
    k, v [B, Hkv, S, D] (a KV cache's slice: any strides but the last), one dtype (``quantized``: k and v int8 or
    E4M3 codes), D a multiple of 8; eagerly."""
    return (
        q.dim() == k.dim() == v.dim() == 4 and q.shape[2] == 1 and k.shape == v.shape and k.shape[2] > 0
        and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3] and q.shape[3] % 8 == 0
        and q.shape[1] % k.shape[1] == 0 and q.dtype in DTYPE_CODES and k.dtype == v.dtype
        and (k.dtype in KV_CODES if quantized else k.dtype == q.dtype)
        and q.is_cpu and k.is_cpu and v.is_cpu and q.stride(3) == k.stride(3) == v.stride(3) == 1
        and cpu_library.row_loop_allowed(q, k, v)
    )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for inputs :func:`attention_supported` accepts: [B, H, 1, D] in q's dtype.
    For int8 or E4M3 codes k, v, the keys are ``k * k_scale * k_pos`` and the values ``v * v_scale * v_pos``,
    in fp32: ``k_scale``, ``v_scale`` fp32 [Hkv, D], per KV head and channel ([Hkv], per head, is broadcast);
    ``k_pos``, ``v_pos`` fp32 [B, Hkv, S] (a cache's slice: any strides but the last, both alike), per position
    and KV head, or None. The channel scales are folded into the queries and the weighted sums, the position
    scales into the scores and the weights, never into a copy."""
    if profiler._is_profiler_enabled:
        return torch.ops.qinfer.decode_attention(q, k, v, scale, k_scale, v_scale, k_pos, v_pos)
    return _attention_op(q, k, v, scale, k_scale, v_scale, k_pos, v_pos)


def _attention_op(q, k, v, scale: float, k_scale=None, v_scale=None, k_pos=None, v_pos=None) -> torch.Tensor:
    B, H, _, D = q.shape
    out = torch.empty(B, H, 1, D, dtype=q.dtype)
    scales, pos = [None, None], [None, None]
    if k.dtype in KV_CODES:  # (a KV cache's scales are fp32 [Hkv, D] already: no op per call)
        scales = [x if x.dtype == torch.float32 and x.shape == (k.shape[1], D) and x.is_contiguous()
                  else x.float().reshape(k.shape[1], -1).expand(-1, D).contiguous() for x in (k_scale, v_scale)]
        if k_pos is not None or v_pos is not None:  # a cache's slices: one layout for both, positions contiguous
            if k_pos is None or v_pos is None or not k_pos.shape == v_pos.shape == k.shape[:3]:
                raise ValueError(f"k_pos and v_pos must both be [B, Hkv, S] = {list(k.shape[:3])}, or both None")
            pos = [k_pos, v_pos]
            if not (k_pos.dtype == v_pos.dtype == torch.float32 and k_pos.stride() == v_pos.stride()
                    and k_pos.stride(2) == 1):
                pos = [x.float().contiguous() for x in pos]
    if cpu_library.library()[0].qinfer_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, k.shape[1], k.shape[2], D, q.stride(0),
        q.stride(1), *k.stride()[:3], *v.stride()[:3], scale, DTYPE_CODES[q.dtype],
        KV_CODES.get(k.dtype, DTYPE_CODES[q.dtype]), *(x.data_ptr() if x is not None else None for x in scales),
        *(x.data_ptr() if x is not None else None for x in pos),
        *(pos[0].stride()[:2] if pos[0] is not None else (0, 0)),
    ):
        raise MemoryError("out of memory for a decode step's attention scores")
    return out


def paged_supported(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, quantized: bool) -> bool:
    """A decode step over a paged cache: q [B, H, 1, D] against pages [N, Hkv, P, D] (contiguous, P a power of
    two), one dtype (``quantized``: int8 or E4M3 codes), D a multiple of 8; eagerly."""
    return (
        q.dim() == 4 and k_pages.dim() == 4 and q.shape[2] == 1 and k_pages.shape == v_pages.shape
        and k_pages.shape[3] == q.shape[3] and q.shape[3] % 8 == 0 and q.shape[1] % k_pages.shape[1] == 0
        and k_pages.shape[2] & (k_pages.shape[2] - 1) == 0 and q.dtype in DTYPE_CODES
        and k_pages.dtype == v_pages.dtype and (k_pages.dtype in KV_CODES if quantized else k_pages.dtype == q.dtype)
        and q.is_cpu and k_pages.is_cpu and v_pages.is_cpu and q.stride(3) == 1
        and k_pages.is_contiguous() and v_pages.is_contiguous() and cpu_library.row_loop_allowed(q, k_pages, v_pages)
    )


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                           starts: torch.Tensor, ends: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           k_pos: torch.Tensor | None = None, v_pos: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_attention` of each sequence b over its positions ``starts[b]..ends[b] - 1`` (each range
    non-empty), read through ``block_tables`` [B, M] (int64) from the pages [N, Hkv, P, D] (``qinfer.format``,
    "The paged KV cache"); for codes, ``k_scale``, ``v_scale`` fp32 [Hkv, D] and ``k_pos``, ``v_pos`` fp32
    [N, Hkv, P]. -> [B, H, 1, D] in q's dtype."""
    if profiler._is_profiler_enabled:
        return torch.ops.qinfer.paged_decode_attention(q, k_pages, v_pages, block_tables, starts, ends, scale,
                                                       k_scale, v_scale, k_pos, v_pos)
    return _paged_op(q, k_pages, v_pages, block_tables, starts, ends, scale, k_scale, v_scale, k_pos, v_pos)


def _paged_op(q, k_pages, v_pages, block_tables, starts, ends, scale: float, k_scale=None, v_scale=None, k_pos=None,
              v_pos=None) -> torch.Tensor:
    B, H, _, D = q.shape
    out = torch.empty(B, H, 1, D, dtype=q.dtype)
    tables, starts, ends = (x.to(torch.int64).contiguous() for x in (block_tables, starts, ends))
    if not bool((ends > starts).all()):
        raise ValueError("every sequence attends at least one position (starts < ends)")
    codes = k_pages.dtype in KV_CODES
    scales = [x.float().reshape(k_pages.shape[1], -1).expand(-1, D).contiguous() if codes else None
              for x in (k_scale, v_scale)]
    pos = [x.float().contiguous() if codes and x is not None else None for x in (k_pos, v_pos)]
    if cpu_library.library()[0].qinfer_paged_decode_attention(
        q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), out.data_ptr(), B, H, k_pages.shape[1], D,
        q.stride(0), q.stride(1), scale, DTYPE_CODES[q.dtype], KV_CODES.get(k_pages.dtype, DTYPE_CODES[q.dtype]),
        *(x.data_ptr() if x is not None else None for x in (*scales, *pos)),
        tables.data_ptr(), tables.stride(0), k_pages.shape[2], starts.data_ptr(), ends.data_ptr(),
    ):
        raise MemoryError("out of memory for a decode step's attention scores")
    return out


OPS.define("decode_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? k_scale=None, "
           "Tensor? v_scale=None, Tensor? k_pos=None, Tensor? v_pos=None) -> Tensor")
OPS.impl("decode_attention", _attention_op, "CPU")


@torch.library.register_fake("qinfer::decode_attention")
def _(q, k, v, scale, k_scale=None, v_scale=None, k_pos=None, v_pos=None):
    return q.new_empty(q.shape)


OPS.define("paged_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_tables, Tensor starts, "
           "Tensor ends, float scale, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_pos=None, "
           "Tensor? v_pos=None) -> Tensor")
OPS.impl("paged_decode_attention", _paged_op, "CPU")


@torch.library.register_fake("qinfer::paged_decode_attention")
def _(q, k_pages, v_pages, block_tables, starts, ends, scale, k_scale=None, v_scale=None, k_pos=None, v_pos=None):
    return q.new_empty(q.shape)
