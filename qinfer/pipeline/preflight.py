"""Checks ``qinfer quantize`` runs on the loaded model before any calibration work, so that a run that cannot
finish (a linear the integer layout cannot hold, a NaN or Inf in any weight, windows past the model's context,
activations that do not fit in memory) stops in seconds with one line instead of failing, or being killed,
minutes in."""

import dataclasses
from pathlib import Path

import torch

from qinfer.model.arch import ModelConfig
from qinfer.store.memory import available_memory
from qinfer.calib.capture import KEEP_DTYPE, compute_dtype
from qinfer.errors import QinferError
from qinfer.format import GROUP_SIZES, QuantScheme, check_int_shape
from qinfer.model.decoder import Transformer
from qinfer.pipeline.config import CalibConfig, TuneConfig


def check_shapes(model: Transformer, scheme: QuantScheme) -> None:
    """Raise a ``QinferError`` naming the first linear whose shape the integer layout cannot hold, and a group
    size that fits every linear (or -1, per channel, where none of 32, 64, 128 does)."""
    if scheme.format != "int":
        return  # FP8's per-channel or per-tensor scales fit any shape
    linears = _int_linears(model, scheme)
    misfit = _misfit(linears, scheme.group_size)
    if misfit:
        fits = _fits(linears)
        fix = (f"--group-size {max(fits)} (it divides every linear's in_features) or -1 (per channel)" if fits else
               f"--group-size -1 (per channel): none of {', '.join(str(g) for g in GROUP_SIZES if g > 0)} divides "
               "every linear's in_features")
        raise QinferError(f"{misfit[0]}: group_size {scheme.group_size} does not divide in_features K={misfit[1]}; "
                          f"use {fix}")
    for name, shape, bits in linears:
        check_int_shape(shape, bits, scheme.group_size, name)


def fitting_group_size(model: Transformer, scheme: QuantScheme) -> tuple[int, int, str, int] | None:
    """For an integer ``scheme`` whose group size does not divide some quantized linear's K: the largest group
    size below it that divides every one, the next larger size, and the first linear that one does not divide
    with its K (None: the scheme's fits, or none does). SmolLM2's 576 takes 64: (64, 128, "...q_proj", 576)."""
    if scheme.format != "int" or scheme.group_size == -1:
        return None
    linears = _int_linears(model, scheme)
    fits = [g for g in _fits(linears) if g < scheme.group_size]
    if not _misfit(linears, scheme.group_size) or not fits:
        return None
    larger = min(g for g in GROUP_SIZES if g > max(fits))
    return (max(fits), larger, *_misfit(linears, larger))


def fitted_scheme(folder: Path, scheme: QuantScheme) -> QuantScheme:
    """``scheme`` with the group size :func:`fitting_group_size` gives ``folder``'s model, from its config alone
    (a model on the meta device: no weights read), for naming its output before it is quantized."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_folder(folder))
    fit = fitting_group_size(model, scheme)
    return dataclasses.replace(scheme, group_size=fit[0]) if fit else scheme


def _int_linears(model: Transformer, scheme: QuantScheme) -> list[tuple[str, tuple[int, ...], int]]:
    # (name, [N, K], bits) of every linear quantized to integers
    linears = [(f"model.layers.{i}.{name}", tuple(block.get_submodule(name).weight.shape), scheme.bits)
               for i, block in enumerate(model.model.layers) for name in model.config.arch.linear_names]
    head = scheme.lm_head_scheme()
    if scheme.quantize_lm_head and head.format == "int":
        linears.append(("lm_head", tuple(model.lm_head.weight.shape), head.bits))
    return linears


def _misfit(linears, group_size: int) -> tuple[str, int] | None:
    # the first (name, K) whose K group_size does not divide
    return next(((name, shape[-1]) for name, shape, _ in linears if group_size != -1 and shape[-1] % group_size), None)


def _fits(linears) -> list[int]:
    # the group sizes that divide every linear's K
    return [g for g in GROUP_SIZES if g > 0 and _misfit(linears, g) is None]


def check_finite(model: Transformer) -> None:
    """Raise a ``QinferError`` naming the first tensor that holds a NaN or an infinity. A quantizer would meet
    one in a linear only when it reached that block, and one in a norm or the embedding never: the run would
    finish and write a model whose every output is NaN."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point():
            continue
        rows = t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)
        for start in range(0, rows.shape[0], 1 << 14):  # a bounded bool temporary, whatever the table's size
            if not bool(torch.isfinite(rows[start:start + (1 << 14)]).all()):
                raise QinferError(f"{name} contains NaN or Inf: the checkpoint is damaged; download or convert it "
                                  "again")


def calibration_bytes(model: Transformer, calib: CalibConfig, tune: TuneConfig) -> int:
    """A lower bound on what calibration holds at once: the model's weights; the [S, L, C] residual stream,
    the unquantized model's beside it (--fp-target, tuning) and the block input kept for tuning; a staged pass's
    kept o_proj / down_proj inputs; one [L, L] attention mask per sliding window. Hessians and one batch's
    intermediates come on top."""
    c = model.config
    tokens = calib.samples * calib.seq_len
    dtype = compute_dtype(model.device)
    streams = 1 + (calib.fp_target or tune.active) + bool(tune.steps and calib.true_sequential)
    kept = max(c.intermediate_size, c.num_heads * c.head_dim) * KEEP_DTYPE.itemsize if calib.true_sequential else 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    masks = len(set(c.sliding_window)) * calib.seq_len**2
    return weights + tokens * (streams * c.hidden_size * dtype.itemsize + kept) + masks


def check_seq_len(seq_len: int, context: int) -> None:
    """Refuse calibration windows of ``seq_len`` tokens longer than the model's ``context``."""
    if seq_len > context:
        raise QinferError(f"--seq-len {seq_len} is longer than the model's context of {context} tokens: "
                          "lower --seq-len")


def check_calibration_size(model: Transformer, calib: CalibConfig, tune: TuneConfig) -> None:
    """Refuse calibration windows the model cannot read or the machine cannot hold, before any work."""
    check_seq_len(calib.seq_len, model.config.max_position_embeddings)
    need, free = calibration_bytes(model, calib, tune), available_memory()
    if free is not None and need > free:
        gib = 1 << 30
        raise QinferError(
            f"calibration needs at least {need / gib:.1f} GiB for the model and its activations ({calib.samples} "
            f"samples x {calib.seq_len} tokens) but {free / gib:.1f} GiB of memory is available: lower --samples "
            "or --seq-len"
        )
