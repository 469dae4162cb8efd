"""CPU path for one bf16 row times an integer weight the int4 kernel does not take: 2, 3 or 8 bits, or 4
bits per channel. A decode step at batch 1 (and every step's lm_head under ``--quantize-lm-head``), where
``gemv_cpu``'s C kernel is not built.

The reference dequantizes the whole weight on every call, far slower than a bf16 GEMV for gemma3's 8-bit
lm_head (docs/results.md, "Figures formerly in code comments"). PyTorch's int8 weight-only matmul
``torch.ops.aten._weight_int8pack_mm(x, q, s)`` computes ``(x @ q^T) * s`` for int8 ``q [N, K]`` and one scale
per row, reading a byte per weight. qinfer's groups (``w = (q - z) * s`` per group of G along K) map onto one
call per group:
``y = sum_g s_g * (x_g @ (q_g - o)^T) - sum_g s_g * (z_g - o) * sum(x_g)``, with ``o = 2^(bits-1)``, the
middle of the code range: ``q - o`` fits int8, a symmetric weight's zero term vanishes (its ``z`` is ``o``),
and an asymmetric one's stays small, so the partial products carry little that the zero term cancels. The
codes are converted once per weight to int8 ``[N, G]`` blocks, one per group, and cached beside it (a byte
per weight; the 8-bit weight's own codes are a byte too).

The kernel's scale is 1 and every group's bf16 partial product is scaled and summed in fp32, so the
error is a bf16 rounding per group (relative 2^-9 each; the reference rounds every dequantized weight to
bf16 instead). Prefills, other dtypes and devices take the reference.
"""

import torch

from qinfer.format import QuantizedWeight
from qinfer.kernels.prepared import per_weight, zero_groups

_BLOCKS: dict[int, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}


def supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    # The op's AVX-512 kernel (torch 2.13) reads past a K that is not a multiple of 16 and returns garbage (up to
    # inf); groups of 32-128 always are, a per-channel weight's K (its one group) need not be.
    group = weight.shape[1] if weight.group_size == -1 else weight.group_size
    return (
        x.device.type == "cpu"
        and x.numel() == x.shape[-1]
        and x.dtype == torch.bfloat16
        and group % 16 == 0
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    )


def _blocks(weight: QuantizedWeight) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per group: int8 codes - o [N, G]; and scales [K/G, N], zero terms s * (z - o) [N, K/G] (None when
    symmetric: z = o), unit scales [N]."""
    return per_weight(_BLOCKS, weight, _convert)


def _convert(weight: QuantizedWeight) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor]:
    N, K = weight.shape
    G = K if weight.group_size == -1 else weight.group_size
    offset = 1 << (weight.bits - 1)
    raw = weight.codes()
    codes = (raw.to(torch.int16) - offset).to(torch.int8)  # [N, K]
    scale = weight.scale.float().T.contiguous()  # [K/G, N]: group g's scales are one contiguous row
    zero_terms = None if weight.zero is None else (scale.T * (weight.zero.float() - offset))  # symmetric: none
    if zero_terms is not None:
        # groups of zero weights (prepared.zero_groups; quantizers older than the middle zero point gave them scale
        # 1, far above the other groups'): exactly 0 here, not a bf16 product the zero term cancels
        empty = zero_groups(weight.qweight, weight.zero, weight.bits, G)  # [N, K/G]
        codes.view(N, K // G, G)[empty] = 0
        zero_terms[empty] = 0.0
    blocks = [codes[:, g : g + G].contiguous() for g in range(0, K, G)]
    return blocks, scale, zero_terms, torch.ones(N, dtype=torch.bfloat16)


def int8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K] holding one bf16 row; returns [..., N] in bf16; caller checked supported(x, weight)
    blocks, scale, zero_terms, ones = _blocks(weight)
    row = x.reshape(1, -1).contiguous()  # the int8 kernel reads K contiguous values (a strided view is copied)
    G = blocks[0].shape[1]
    y = None
    for g, block in enumerate(blocks):
        part = torch.ops.aten._weight_int8pack_mm(row[:, g * G : (g + 1) * G], block, ones)[0] * scale[g]  # fp32
        y = part if y is None else y.add_(part)
    if zero_terms is not None:
        y -= zero_terms @ row.float().view(-1, G).sum(-1)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
