"""RMSNorm, the norm of every supported family: ``x / rms(x) * (offset + w)``.

``rms_norm_ref`` is the plain-torch definition (the mean of squares always in fp32; bf16 would lose the small
terms). ``rms_norm`` is the entry point the model calls: a decode step's few rows on CPU go to ``norm_cpu``'s
C loop, which computes the same roundings in one call, where PyTorch's path is a dozen small ops (their
dispatch, not their arithmetic, is what a decode step pays for; docs/RESULTS-LOG.md); everything else, and
anything ``torch.compile`` traces, takes the reference.
"""

import torch

from qinfer.kernels import norm_cpu


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    # x: [..., D]; weight: [D]; returns x's shape and dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_fp32:  # Gemma: (x * (1 + w)) rounded once
        return (xf * (offset + weight.float())).type_as(x)
    return weight * xf.type_as(x)  # Llama: round x, then scale in the weight's dtype


all_rows = norm_cpu.all_rows  # the C loop for every row count (an engine step's decode rows)
norm_rows_max = norm_cpu.rows_max  # the most rows the C loop takes now


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_fp32: bool) -> torch.Tensor:
    if norm_cpu.rms_norm_supported(x, weight, scale_in_fp32):
        return norm_cpu.rms_norm(x, weight, eps, offset, scale_in_fp32)
    return rms_norm_ref(x, weight, eps, offset, scale_in_fp32)
