"""Triton dequant-matmul for the qinfer format's packed weights: the GPU path of ``quant_linear`` and
``fp8_linear``.

``dequant_matmul(x, weight)`` computes ``y = x @ W^T`` for ``x [M, K]`` (the weight's stored column order) and
a packed ``W [N, K]``, reading the format's tensors as they are stored (``qinfer.format``). Integer weights
of 2, 3, 4 or 8 bits, any group size, symmetric or not:

    code  q[n, k] = (u16[n, i // 8] >> (i % 8)) & (2^b - 1),   i = k * b, the stream bit of code k
          u16[n, j] = qweight[n, j] | qweight[n, j + 1] << 8   (a 3-bit code may straddle two bytes)
    w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]   zero = 2^(b-1) when symmetric

FP8 E4M3 weights, per-channel or per-tensor scale: each code's bits moved into an fp16 number, as
``qinfer.format.e4m3_as_fp16`` does (exact, value / 2^8; no native float8 conversion, which GPUs before
Ada lack):

    w[n, k] = fp16_bits((c & 0x80) << 8 | (c & 0x7F) << 7) * 2^8 * scale[n or 0]

and in both cases ``y[m, n] = sum_k x[m, k] * w[n, k]``, in fp32, then cast to x's dtype.

Each program dequantizes a ``[BLOCK_N, BLOCK_K]`` tile of W into registers in fp32 and multiplies it there:
the dense weight never exists in memory, so a step reads b/8 bytes per weight plus the scales. Neighbouring
codes share bytes, whose repeated loads a GPU serves from its L1 cache. Two kernels, by the rows of x:

- ``_gemm_kernel`` (``M >= GEMM_MIN_ROWS``, a prefill): ``BLOCK_M x BLOCK_N`` output tiles, ``tl.dot`` per K
  tile. Its inputs are fp32; a half-precision ``x`` is exact in tf32 (10 mantissa bits hold bf16's 7 and
  fp16's 10), so tensor cores may multiply it as tf32 while W's rounding to tf32 (relative 2^-11) stays below
  the reference path's rounding to bf16 (2^-8). An fp32 ``x`` multiplies in IEEE fp32.
- ``_gemv_kernel`` (fewer rows, a decode step): one row and ``BLOCK_N`` outputs per program, a broadcast
  multiply and a row sum per K tile; a tensor-core tile has 16 rows (mma's M), 15 of them padding here.

``dequant_matmul_ref`` is the same product in plain torch (the whole weight dequantized in fp32). Block sizes
are fixed, not autotuned (autotuning several configurations needs a GPU driver, which this project's
machines do not have). No GPU has run them: the tests check them against the reference in Triton's
interpreter on CPU (``TRITON_INTERPRET=1``) and compile them to cubins for Turing, Ampere and Hopper.
"""

import torch
import triton
import triton.language as tl

from qinfer.format import Fp8Weight, QuantizedWeight, dequantize_codes

GEMM_MIN_ROWS = 16  # a tensor-core tile's rows; fewer rows take the GEMV kernel
_GEMM_BLOCKS = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64)
_GEMV_BLOCKS = dict(BLOCK_N=64, BLOCK_K=128)


@triton.jit
def _weight_tile(qw_ptr, s_ptr, z_ptr, rn, rk, N, K, stride_qn, stride_sn,
                 G: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, FP8: tl.constexpr):
    """W[rn, rk] in fp32, ``[BLOCK_N, BLOCK_K]``; 0 outside ``N x K``."""
    inside = (rn[:, None] < N) & (rk[None, :] < K)
    row = qw_ptr + rn[:, None].to(tl.int64) * stride_qn  # offsets in 64 bits, as x's and y's
    if FP8:  # one byte per weight; stride_sn is 0 for a per-tensor scale
        c = tl.load(row + rk[None, :], mask=inside, other=0).to(tl.int32)
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        scale = tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=rn < N, other=0).to(tl.float32)
        w = half.to(tl.float32) * (scale * 256.0)[:, None]
    else:
        bit = rk * BITS  # [BLOCK_K] the stream bit where each code starts
        lo = tl.load(row + (bit // 8)[None, :], mask=inside, other=0).to(tl.int32)
        if BITS == 3:  # a code may continue into the next byte; the last byte of a row has no next
            straddles = ((bit + BITS - 1) // 8 > bit // 8)[None, :]
            hi = tl.load(row + (bit // 8 + 1)[None, :], mask=inside & straddles, other=0)
            lo = lo | (hi.to(tl.int32) << 8)
        q = (lo >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
        group = (rk // G)[None, :]
        at = rn[:, None].to(tl.int64) * stride_sn + group
        scale = tl.load(s_ptr + at, mask=inside, other=0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + at, mask=inside, other=0).to(tl.int32)
        else:
            zero = 1 << (BITS - 1)
        w = (q - zero).to(tl.float32) * scale
    return w


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                 G: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, FP8: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[rm, rn] for one ``BLOCK_M x BLOCK_N`` tile: x rows times dequantized W tiles, summed over K."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M x N outputs may pass 2^31
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        # cast right after loading: the interpreter's half-precision arithmetic is not the GPU's
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0).to(tl.float32)
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, rn, rk, N, K, stride_qn, stride_sn, G, BITS, HAS_ZERO, FP8)
        acc += tl.dot(x, tl.trans(w), input_precision=INPUT_PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                 G: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, FP8: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, rn] for one row m and ``BLOCK_N`` outputs: sum over K of W tiles times the row, in fp32."""
    m = tl.program_id(0).to(tl.int64)  # M x N outputs may pass 2^31 (a full-logits lm_head: 8193 rows of 2^18)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0).to(tl.float32)
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, rn, rk, N, K, stride_qn, stride_sn, G, BITS, HAS_ZERO, FP8)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * stride_ym + rn, acc, mask=rn < N)


def dequant_matmul(x: torch.Tensor, weight: QuantizedWeight | Fp8Weight, bias: torch.Tensor | None = None):
    # x: [..., K] in the weight's stored column order; returns [..., N] in x's dtype
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"dequant_matmul: x has {x.shape[-1]} features, the weight takes {K}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dequant_matmul: x must be fp32, bf16 or fp16, got {x.dtype}")
    x2 = x.reshape(-1, K).contiguous()  # [M, K]
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)  # the fp32 sums; cast below
    if isinstance(weight, Fp8Weight):
        codes, scale, zero = weight.weight.contiguous().view(torch.uint8), weight.scale.contiguous(), None
        stride_sn = 0 if weight.granularity == "tensor" else 1
        flags = dict(G=K, BITS=8, HAS_ZERO=False, FP8=True)
    else:
        codes, scale, zero = weight.qweight.contiguous(), weight.scale.contiguous(), weight.zero
        stride_sn = scale.stride(0)
        G = K if weight.group_size == -1 else weight.group_size
        flags = dict(G=G, BITS=weight.bits, HAS_ZERO=zero is not None, FP8=False)
    zero = scale if zero is None else zero.contiguous()  # without zeros: any pointer, never read
    args = (x2, codes, scale, zero, y, M, N, K, x2.stride(0), codes.stride(0), stride_sn, y.stride(0))
    if M >= GEMM_MIN_ROWS:
        grid = (triton.cdiv(M, _GEMM_BLOCKS["BLOCK_M"]), triton.cdiv(N, _GEMM_BLOCKS["BLOCK_N"]))
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _gemm_kernel[grid](*args, **flags, INPUT_PRECISION=precision, **_GEMM_BLOCKS)
    else:
        _gemv_kernel[(M, triton.cdiv(N, _GEMV_BLOCKS["BLOCK_N"]))](*args, **flags, **_GEMV_BLOCKS)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def dequant_matmul_ref(x: torch.Tensor, weight: QuantizedWeight | Fp8Weight, bias: torch.Tensor | None = None):
    """The same product in plain torch: W dequantized in fp32 (stored column order), an fp32 matmul."""
    if isinstance(weight, Fp8Weight):
        w = weight.dequantize(torch.float32)  # [N, K]
    else:  # the format's own dequantization, in stored column order (no unpermute)
        zero = 1 << (weight.bits - 1) if weight.zero is None else weight.zero
        w = dequantize_codes(weight.codes(), weight.scale, zero, weight.group_size)  # [N, K] fp32
    y = x.float() @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
