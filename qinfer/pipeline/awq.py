"""AWQ applied to one decoder block, wired by the architecture table.

For each group of linears that read one input (``ArchSpec.linear_groups``): search input-channel scales
on the captured statistics (mean |x| and the Gram matrix X^T X over every calibration token), fold ``1/s``
into the producer of that input (the RMSNorm, or the linear before), multiply the group's input columns by
``s``, then search and apply per-group weight clipping (each group's range re-picked for its whole row's output
error in two sweeps, see :mod:`qinfer.quantizers.awq`). Like AutoAWQ, q/k are not clipped (their errors are
amplified through the softmax), and a linear-to-linear fold is skipped when the shapes differ (v_proj ->
o_proj under grouped-query attention, where one v channel feeds several o_proj columns) or when the
producer's outputs are cached (v_proj with a quantized KV cache: the scales were calibrated on them).

:func:`apply_awq` does this for the whole block at once, on statistics of the unquantized block; the block
computes the same function in floating point afterwards and the pipeline rounds the rescaled, clipped
weights to nearest. :func:`scale_group` does it for one group inside the staged pass
(:func:`qinfer.calib.capture.calibrate_in_stages`), on the statistics of inputs computed with the groups
before it already quantized, and on the weights the caller hands it (with ``--fp-target``, the weights
aimed at the unquantized model's output). There the producer of down_proj's input, up_proj, is already
quantized: ``1/s`` goes into its float16 group scales, and since the pass has already computed (and kept)
up_proj's old outputs, the pass must compute with ``Q(W s) / s`` for the rest of the block.
"""

from dataclasses import dataclass

import torch

from qinfer.model.arch import LinearGroup
from qinfer.calib.capture import BlockStats, LinearStats
from qinfer.format import QuantizedWeight, QuantScheme
from qinfer.model.decoder import Transformer
from qinfer.quantizers.awq import (
    apply_clip,
    awq_search_clip_gram,
    awq_search_scales_gram,
    fold_scales_into_linear,
    fold_scales_into_norm,
    fold_scales_into_quantized,
    scale_linear_inputs,
)

NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


def apply_awq(model: Transformer, layer_idx: int, stats: BlockStats, scheme: QuantScheme) -> dict[str, float]:
    """Rescale and clip block ``layer_idx``'s linears in place; returns the chosen ratio per group. A rescaled
    group's statistics in ``stats`` become those of its new inputs ``X / s`` (what its rounding is scored on)."""
    arch = model.config.arch
    block = model.model.layers[layer_idx]
    prefix = f"model.layers.{layer_idx}."
    ratios = {}
    for group in arch.linear_groups:
        linears = [block.get_submodule(name) for name in group.linears]
        captured = stats.linears[group.linears[0]]
        H = captured.H / max(captured.n, 1)  # [K, K], per token
        weights = [m.weight.data.float() for m in linears]
        if _scalable(block, group, scheme):
            result = awq_search_scales_gram(captured.abs_mean, H, weights, scheme,
                                            names=[prefix + name for name in group.linears])
            s, ratios[group.linears[0]] = result.scales, result.ratio
            if group.norm is not None:
                _fold_into_norm(block.get_submodule(group.norm), s, arch.norm_offset)
            else:
                prev = block.get_submodule(group.prev)
                bias = None if prev.bias is None else prev.bias.data.float()
                w, b = fold_scales_into_linear(prev.weight.data.float(), s, bias)
                prev.weight.data = w.to(prev.weight.dtype)
                if b is not None:
                    prev.bias.data = b.to(prev.bias.dtype)
            weights = [scale_linear_inputs(W, s) for W in weights]
            H = H / s[:, None] / s[None, :]  # the Gram matrix of the rescaled inputs X / s
            captured.H, captured.abs_sum = captured.H / s[:, None] / s[None, :], captured.abs_sum / s  # (shared)
        for name, module, W in zip(group.linears, linears, weights):
            module.weight.data = clip_linear(name, W, H, scheme, prefix).to(module.weight.dtype)
    return ratios


@dataclass
class ScaledGroup:
    """What :func:`scale_group` leaves to round: the group's fp32 weights, scaled and clipped; the Gram matrix
    of their (rescaled) inputs; and ``pending``, the scales ``s [K]`` folded into an already-quantized producer
    (None otherwise): until the staged pass ends, compute each linear of the group with ``Q(W s) / s``."""

    weights: dict[str, torch.Tensor]
    gram: torch.Tensor
    pending: torch.Tensor | None = None


def scale_group(
    block: torch.nn.Module,
    group: LinearGroup,
    weights: dict[str, torch.Tensor],
    stats: LinearStats,
    scheme: QuantScheme,
    norm_offset: float,
    quantized: dict[str, QuantizedWeight],
    ref_weights: dict[str, torch.Tensor] | None = None,
    prefix: str = "",
) -> ScaledGroup:
    """AWQ's scale and clip search for one group of a block inside the staged pass (see the module docstring).

    ``weights`` are the group's fp32 weights to quantize (maybe aimed); ``stats`` their inputs' statistics;
    ``quantized`` the block's packed linears so far, where a folded producer's scales are replaced. The norm
    is shared by the unquantized stream, which reads it with ``ref_weights``: their columns are scaled too.
    ``prefix`` (``model.layers.{i}.``) makes the linears' names in errors whole.
    """
    H = stats.H
    pending = None
    if _scalable(block, group, scheme):
        s = awq_search_scales_gram(stats.abs_mean, H / max(stats.n, 1), list(weights.values()), scheme,
                                   names=[prefix + name for name in weights]).scales
        if group.norm is not None:
            _fold_into_norm(block.get_submodule(group.norm), s, norm_offset)
            for name in group.linears if ref_weights is not None else ():
                ref_weights[name] = scale_linear_inputs(ref_weights[name], s)
        elif block.get_submodule(group.prev).bias is None and (
            folded := fold_scales_into_quantized(quantized[group.prev], s)
        ) is not None:  # (a biased producer, Qwen2's v_proj, is left alone: its bias would need 1/s too)
            quantized[group.prev], pending = folded, s
        else:
            s = None
        if s is not None:
            weights = {name: scale_linear_inputs(W, s) for name, W in weights.items()}
            H = H / s[:, None] / s[None, :]
    clipped = {name: clip_linear(name, W, H / max(stats.n, 1), scheme, prefix) for name, W in weights.items()}
    return ScaledGroup(clipped, H, pending)


def _scalable(block: torch.nn.Module, group: LinearGroup, scheme: QuantScheme) -> bool:
    """Whether the group's input scales can be folded into its producer."""
    if group.norm is not None:
        return True
    if group.prev == "self_attn.v_proj" and scheme.kv_cache != "none":
        return False  # the V cache's scales were calibrated on v_proj's unscaled outputs
    prev = block.get_submodule(group.prev)
    return all(prev.out_features == block.get_submodule(name).in_features for name in group.linears)


def _fold_into_norm(norm: torch.nn.Module, s: torch.Tensor, offset: float) -> None:
    w, _ = fold_scales_into_norm(norm.weight.data.float(), s, offset=offset)
    norm.weight.data = w.to(norm.weight_dtype(norm.weight.dtype, w.dtype))  # fp32 for Gemma's 1 + w


def clip_linear(name: str, W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, prefix: str = "") -> torch.Tensor:
    """AWQ's clipping search for linear ``name`` (q/k are left alone), ``H`` its inputs' Gram matrix."""
    return W if name in NO_CLIP else apply_clip(W, *awq_search_clip_gram(H, W, scheme, name=prefix + name))
