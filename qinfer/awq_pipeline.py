"""AWQ applied to one decoder block, wired by the architecture table.

For each group of linears that read one input (``ArchSpec.linear_groups``): search input-channel scales
on the captured statistics (mean |x| and the Gram matrix X^T X over every calibration token), fold ``1/s`` into the producer of that input (the RMSNorm, or the linear
before), multiply the group's input columns by ``s``, then search and apply per-group weight clipping.
The block computes the same function in floating point afterwards; the pipeline then quantizes the
rescaled, clipped weights with round-to-nearest. Like AutoAWQ, q/k are not clipped (their errors are
amplified through the softmax), and a linear-to-linear fold is skipped when the shapes differ (v_proj ->
o_proj under grouped-query attention, where one v channel feeds several o_proj columns).

With ``clip=False`` only the scales are applied (the block still computes the same function): the
pipeline's ``--fp-target`` path then aims each group at the unquantized output on freshly captured
statistics and clips it with :func:`clip_linear`, group by group.
"""

import torch

from qinfer.calib.capture import BlockStats
from qinfer.format import QuantScheme
from qinfer.model import Transformer
from qinfer.quantizers.awq import (
    apply_clip,
    awq_search_clip_gram,
    awq_search_scales_gram,
    fold_scales_into_linear,
    fold_scales_into_norm,
    scale_linear_inputs,
)

NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


def apply_awq(
    model: Transformer, layer_idx: int, stats: BlockStats, scheme: QuantScheme, clip: bool = True
) -> dict[str, float]:
    """Rescale and (with ``clip``) clip block ``layer_idx``'s linears in place; returns the chosen ratio per group."""
    arch = model.config.arch
    block = model.model.layers[layer_idx]
    ratios = {}
    for group in arch.linear_groups:
        linears = [block.get_submodule(name) for name in group.linears]
        captured = stats.linears[group.linears[0]]
        H = captured.H / max(captured.n, 1)  # [K, K], per token
        weights = [m.weight.data.float() for m in linears]
        if group.norm is not None or _foldable(block.get_submodule(group.prev), linears):
            result = awq_search_scales_gram(captured.abs_mean, H, weights, scheme)
            s, ratios[group.linears[0]] = result.scales, result.ratio
            if group.norm is not None:
                norm = block.get_submodule(group.norm)
                w, _ = fold_scales_into_norm(norm.weight.data.float(), s, offset=arch.norm_offset)
                norm.weight.data = w.to(norm.weight_dtype(norm.weight.dtype, w.dtype))  # fp32 for Gemma's 1 + w
            else:
                prev = block.get_submodule(group.prev)
                bias = None if prev.bias is None else prev.bias.data.float()
                w, b = fold_scales_into_linear(prev.weight.data.float(), s, bias)
                prev.weight.data = w.to(prev.weight.dtype)
                if b is not None:
                    prev.bias.data = b.to(prev.bias.dtype)
            weights = [scale_linear_inputs(W, s) for W in weights]
            H = H / s[:, None] / s[None, :]  # the Gram matrix of the rescaled inputs X / s
        for name, module, W in zip(group.linears, linears, weights):
            if clip:
                W = clip_linear(name, W, H, scheme)
            module.weight.data = W.to(module.weight.dtype)
    return ratios


def clip_linear(name: str, W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """AWQ's clipping search for linear ``name`` (q/k are left alone), ``H`` its inputs' Gram matrix."""
    return W if name in NO_CLIP else apply_clip(W, awq_search_clip_gram(H, W, scheme))


def _foldable(prev, linears) -> bool:
    return all(prev.out_features == m.in_features for m in linears)
