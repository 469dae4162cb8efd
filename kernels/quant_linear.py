"""Reference kernels for packed weights: dequantize the whole weight, then a dense matmul.

Correct for every format and device, and the definition the fast kernels are tested against; it reads
the packed bytes but then materialises the dense weight, so it saves memory on disk, not time.
"""

import torch
import torch.nn.functional as F

from qinfer.format import Fp8Weight, QuantizedWeight


def dequant_linear_ref(x: torch.Tensor, weight: QuantizedWeight | Fp8Weight, bias: torch.Tensor | None = None):
    # x: [..., K]; weight: packed [N, K]; returns [..., N] in x's dtype
    return F.linear(x, weight.dequantize(x.dtype), bias)
