"""The quantize pipeline: walk the model block by block, calibrate, quantize, write the qinfer format.

Sequential: block i is calibrated on the outputs of the already-quantized blocks 0..i-1, so each
block's quantizer sees (and can compensate) the error that reaches it. With ``CalibConfig.true_sequential``
(GPTQ's default; AWQ's on request) the same holds inside a block: each group of linears that share an input
(q/k/v, o, gate/up, down) is calibrated on inputs computed with the groups before it already quantized.
That runs the block in stages (:func:`qinfer.calib.capture.calibrate_in_stages`), one pass with the final
weights; without it, the block runs twice: once with its unquantized weights to capture every group, once
quantized for its output.

Memory stays bounded by the bf16 model (memory-mapped) plus one block's activations [S, L, C].
Blocks run in bf16 (the model's own compute dtype, and AMX-fast on CPU) where the device has fast bf16
matmuls, else in fp32 one block at a time (``calib.capture.compute_dtype``: AVX2-only CPUs); the
activations are kept in the same dtype. Quantizers work on fp32 copies of each weight.

With ``CalibConfig.fp_target`` (GPTQ or AWQ) a second stream of activations runs beside the first through the
*unquantized* blocks, and each linear is fitted to the unquantized model's output on that stream's inputs
(:func:`qinfer.quantizers.gptq.fp_target`) rather than to its own output on the quantized stream's, so
the drift that earlier blocks left is corrected where it arises. It implies ``true_sequential``: a group's
input is captured after the groups before it (already aimed at the unquantized output) are quantized, or
the drift would be corrected twice.

AWQ is not sequential by default (like AutoAWQ): it searches and folds the scales of all groups on the
unquantized block's statistics, clips, and rounds to nearest. Sequential (``--true-sequential``, implied by
``--fp-target``), each group's scales and clipping are searched in the staged pass on its own inputs, with
the groups before it quantized, and on the weights it will be rounded from (aimed ones with ``--fp-target``;
see :func:`qinfer.pipeline.awq.scale_group`).

With tuning (``TuneConfig.steps > 0``, see :mod:`qinfer.pipeline.block_tune`) a second stream of activations runs
beside the first through the *unquantized* blocks; once block i's linears are quantized, its scales and
norms are tuned towards that stream's block-i output. That doubles the activations kept (two [S, L, C]).
"""

import functools
import json
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from qinfer.pipeline.awq import apply_awq, scale_group
from qinfer.pipeline.block_tune import E2E_EVAL_SAMPLES, rounding_residual, tune_block, tune_end_to_end
from qinfer.store.atomic import atomic_dir, check_output, save_tensors
from qinfer.store.fingerprint import source_fingerprint
from qinfer.calib.capture import (
    block_in,
    calibrate_in_stages,
    capture_block,
    compute_dtype,
    embed_samples,
    first_kept,
    return_freed_memory,
    reuse_freed_memory,
    run_block,
)
from qinfer.calib.sampling import repeat_note, sample_windows_from_stream
from qinfer.calib.sources import load_calibration_documents
from qinfer.errors import QinferError
from qinfer.format import Fp8Weight, QuantScheme
from qinfer.interop.folders import SIDE_FILES
from qinfer.model.loader import bos_tensors, drop_pages, load_model, weight_files
from qinfer.model.decoder import BosState, Transformer
from qinfer.pipeline.config import CalibConfig, TuneConfig, check_settings, recorded_calibration, uses_calibration
from qinfer.pipeline.preflight import check_calibration_size, check_finite, check_shapes, fitting_group_size
from qinfer.quantizers.fp8 import fp8_kv_scale, fp8_quantize, int8_kv_scale
from qinfer.quantizers.gptq import fp_target, gptq_quantize_ex
from qinfer.quantizers.rtn import ACTIVATIONS_OVERFLOW, rtn_quantize
from qinfer.sources.tokenizer import Tokenizer

# Output rows of the lm_head quantized at a time (gemma3's 262144 x 640 in 8 slices of 84 MB in fp32).
LM_HEAD_ROWS = 32768

# The code that decides what a quantization writes; its fingerprint goes into quantize_report.json so a
# cached quantized folder (the main job's) is redone after a change to any of it: this module and every qinfer
# module it and they import (which windows are drawn, how they tokenize, how the blocks compute), bar the error
# type, the store (paths, atomic writes) and qinfer.interop.folders (quantize reads only its side files' names).
QUANTIZE_MODULES = (
    "qinfer.pipeline.quantize", "qinfer.pipeline.config", "qinfer.pipeline.awq", "qinfer.pipeline.block_tune",
    "qinfer.pipeline.preflight", "qinfer.calib.capture", "qinfer.calib.sampling", "qinfer.calib.sources",
    "qinfer.calib.austen", "qinfer.calib.debian", "qinfer.calib.rlazyload", "qinfer.sources.tokenizer",
    "qinfer.model.arch", "qinfer.model.decoder", "qinfer.model.decode_plan", "qinfer.model.kv_cache",
    "qinfer.model.loader", "qinfer.format",
)
QUANTIZE_PACKAGES = ("qinfer.quantizers", "qinfer.kernels")  # read whole


@functools.cache
def code_fingerprint() -> str:
    """sha256 over the source of :data:`QUANTIZE_MODULES` and of every module in :data:`QUANTIZE_PACKAGES`."""
    return source_fingerprint(QUANTIZE_MODULES, *QUANTIZE_PACKAGES)


@dataclass
class QuantizeReport:
    out: Path
    bytes_before: int
    bytes_after: int
    quantized_params: int
    quantized_bits: int  # storage of the quantized linears, scales and zeros included
    seconds: float
    peak_rss_bytes: int
    layer_errors: dict[str, float] = field(default_factory=dict)
    raised_damping: dict[str, float] = field(default_factory=dict)  # GPTQ: linear -> the damping it had to raise to
    tune_losses: dict[str, tuple[float, float]] = field(default_factory=dict)  # block -> (before, after)
    tune_discarded: list[str] = field(default_factory=list)  # blocks whose tuning raised the error (undone)
    tune_best_steps: dict[str, int] = field(default_factory=dict)  # --tune-holdout: block -> the step kept
    tune_held_out: dict[str, list] = field(default_factory=dict)  # --tune-holdout: block -> [(step, loss)] checks
    e2e_kl: tuple[float, float] | None = None  # end-to-end tuning: KL to the unquantized model (before, after)
    e2e_samples: int = 0  # ... over this many calibration samples
    e2e_discarded: bool = False  # end-to-end tuning raised that KL (or reached NaN): undone
    compute_dtype: str = "bfloat16"  # what the blocks ran in during calibration
    embedding_bits: int | None = None  # a tied embedding read from the quantized lm_head: its bits
    lm_head_method: str | None = None  # how a quantized lm_head was quantized: gptq, or rtn / fp8 (to nearest)
    kept_bos: bool = False  # what the unquantized model computes at the BOS position is stored
    calibration_text_tokens: int | None = None  # tokens of calibration text the windows were drawn from (None: none)

    @property
    def effective_bits(self) -> float:
        return self.quantized_bits / max(self.quantized_params, 1)

    def sizes(self) -> str:
        """The summary's one line of sizes, bits per weight, time and memory."""
        mib = 1 << 20
        return (f"size {self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB; "
                f"{self.effective_bits:.3f} bits per quantized weight (scales included); "
                f"{self.seconds:.0f} s; peak RSS {self.peak_rss_bytes / mib:.0f} MiB")

    def summary(self) -> str:
        text = f"wrote {self.out}\n{self.sizes()}"
        kept = sorted(after / before for before, after in self.tune_losses.values() if before > 0)
        if kept:
            text += f"\ntuning left {kept[len(kept) // 2]:.0%} of the block output error (median over blocks)"
            if self.tune_discarded:
                text += f"; undone in {len(self.tune_discarded)} where it raised it ({', '.join(self.tune_discarded)})"
            if self.tune_best_steps:
                steps = sorted(self.tune_best_steps.values())
                text += f"; held-out check kept step {steps[len(steps) // 2]} (median over blocks)"
        if self.raised_damping:  # (a Hessian summed from bf16 products can be indefinite: o_proj's in gemma3-270m)
            n = len(self.raised_damping)
            name, damp = next(iter(self.raised_damping.items()))
            text += (f"\nGPTQ raised the damping of {n} linear{'s' * (n != 1)} whose Hessian was not positive definite, "
                     f"{'e.g. ' * (n != 1)}{name} to {damp:g} (quantize_report.json: raised_damping)")
        if self.kept_bos:
            text += "\nthe BOS position's keys, values and output are the unquantized model's (stored; --no-keep-bos: not)"
        if self.embedding_bits is not None:
            text += f"\nthe tied embedding is read from the {self.embedding_bits}-bit lm_head (not stored on its own)"
        if self.e2e_kl is not None:
            text += (f"\nend-to-end tuning: KL to the unquantized model {self.e2e_kl[0]:.4f} -> {self.e2e_kl[1]:.4f} "
                     f"(first {self.e2e_samples} calibration samples)")
            if self.e2e_discarded:
                text += "; undone: it raised the KL (a lower --tune-lr may help)"
        return text


def calibration_batch(folder: Path, calib: CalibConfig) -> torch.Tensor:
    """[samples, seq_len] token ids: BOS + seq_len - 1 tokens of calibration text where the tokenizer starts text with
    a BOS (as inference sees text), else seq_len tokens of it (SmolLM2, Qwen: ``add_bos_token`` false)."""
    return _calibration_windows(folder, calib)[0]


def _calibration_windows(folder: Path, calib: CalibConfig) -> tuple[torch.Tensor, int, str | None]:
    """:func:`calibration_batch`, how many tokens the text they were drawn from holds (as far as it was read), and a
    note if the windows read that text several times over."""
    tok = Tokenizer.from_folder(folder)
    docs = load_calibration_documents(calib.source)
    bos = [] if tok.leading_bos is None else [tok.leading_bos]
    body, stream_tokens = sample_windows_from_stream(
        docs, lambda t: tok.encode(t, add_bos=False), calib.samples, calib.seq_len - len(bos), calib.seed)
    bos_column = torch.tensor([bos] * calib.samples, dtype=torch.long).reshape(calib.samples, -1)
    return torch.cat([bos_column, body], dim=1), stream_tokens, repeat_note(*body.shape, stream_tokens)


@dataclass
class _Walk:
    """One quantize run as it walks the blocks: the model, the calibration activations, and what is to be saved.

    ``X`` [S, L, C] is the next block's input computed through the blocks quantized so far; ``X_ref`` the same
    through the unquantized blocks, carried where tuning or ``--fp-target`` aims at the unquantized model.
    """

    model: Transformer
    scheme: QuantScheme  # as given, or with the group size that fits (``fit_group_size``)
    calib: CalibConfig  # resolved for the method
    tune: TuneConfig
    dtype: torch.dtype  # the blocks run in this while they are calibrated
    ids: torch.Tensor | None  # [S, L] calibration token ids; None where nothing reads calibration text
    X: torch.Tensor | None
    X_ref: torch.Tensor | None
    bos: BosState | None  # what the unquantized model computes at the BOS position, stored (--keep-bos)
    report: QuantizeReport
    quantized: dict = field(default_factory=dict)  # "model.layers.{i}.{linear}" -> packed weight
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the other tensors saved

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return tuple(g.linears for g in self.model.config.arch.linear_groups)


def quantize_model(
    folder: Path, out: Path, scheme: QuantScheme, calib: CalibConfig, force: bool = False,
    tune: TuneConfig | None = None, fit_group_size: bool = False,
) -> QuantizeReport:
    """Quantize the model in ``folder`` into ``out``. ``fit_group_size`` (the group size was not chosen by the
    user): where ``scheme.group_size`` does not divide a linear's in_features, take the largest that does, with a
    note, instead of refusing.

    Three steps: capture (load the model, check it, embed the calibration windows), quantize each block in turn
    on the activations the blocks before it produce, then save the folder in one rename."""
    folder, out = Path(folder), Path(out)
    tune = tune or TuneConfig()
    calib = check_settings(scheme, calib, tune)
    check_output(out, force, source=folder)
    if (folder / "quant_config.json").exists():
        raise QinferError(f"{folder} is already quantized: quantize the original model instead")
    start = time.perf_counter()
    walk = _capture(folder, out, scheme, calib, tune, fit_group_size)
    label = walk.scheme.method + (" + tuning" if tune.active else "")
    for i in tqdm(range(walk.model.config.num_layers), desc=f"quantizing ({label})", unit="block"):
        _quantize_block(walk, i)
    if tune.e2e_steps:
        _tune_end_to_end(walk)
    _collect(walk)
    return _save(walk, folder, out, force, start)


def _capture(folder: Path, out: Path, scheme: QuantScheme, calib: CalibConfig, tune: TuneConfig,
             fit_group_size: bool) -> _Walk:
    """Load the model and check it (shapes, finite weights, the tokenizer, room for the activations) before any
    calibration work; draw the calibration windows and embed them."""
    reuse_freed_memory()
    model = load_model(folder, dtype=torch.bfloat16)
    fit = fitting_group_size(model, scheme) if fit_group_size else None
    if fit:
        print(f"note: group size {fit[0]}: the largest that divides every linear's in_features ({fit[2]} reads "
              f"{fit[3]}, which {fit[1]} does not divide); --group-size chooses", file=sys.stderr)
        scheme = replace(scheme, group_size=fit[0])
    check_shapes(model, scheme)  # before any calibration work
    check_finite(model)
    Tokenizer.from_folder(folder)  # copied into OUT, which every other command reads it from: refuse a broken one
    needs_calib = uses_calibration(scheme, tune)
    if needs_calib:
        check_calibration_size(model, calib, tune)
    ids, stream_tokens, note = _calibration_windows(folder, calib) if needs_calib else (None, None, None)
    if note:
        print(f"note: {note}", file=sys.stderr)
    dtype = compute_dtype(model.device)
    bos = _own_bos(model, ids) if calib.keep_bos else None
    model.set_bos(bos)  # calibration sees what inference will: the stored BOS position
    X = embed_samples(model, ids, dtype) if needs_calib else None
    # Tuning and --fp-target aim at the unquantized model's outputs: carry that stream beside the quantized one.
    X_ref = X.clone() if tune.active or calib.fp_target else None
    # check_finite and the BOS position read every weight into memory: let them go (each block's is faulted back
    # in from the file when the loop reaches it; the embedding, a third of gemma3-270m, at the end)
    drop_pages(model.parameters())
    report = QuantizeReport(out, _folder_bytes(folder), 0, 0, 0, 0.0, 0, compute_dtype=str(dtype).removeprefix("torch."),
                            calibration_text_tokens=stream_tokens)
    return _Walk(model, scheme, calib, tune, dtype, ids, X, X_ref, bos, report)


def _quantize_block(walk: _Walk, i: int) -> None:
    """Quantize block ``i``'s linears on the activations that reach it, measure its K/V ranges, tune it if asked,
    and move ``walk.X`` (and ``walk.X_ref``) on to its output."""
    model, scheme, calib, tune, dtype, report = walk.model, walk.scheme, walk.calib, walk.tune, walk.dtype, walk.report
    groups, sequential = walk.groups, calib.true_sequential  # (resolved: --fp-target implies it)
    block = model.model.layers[i]
    loaded = list(block.state_dict().values())  # views into the memory-mapped checkpoint (for a bf16 one)
    stats = None
    with block_in(block, dtype, back=model.dtype):
        if walk.X_ref is not None and not calib.fp_target:  # tuning's target, before anything in block i changes
            walk.X_ref = run_block(model, i, walk.X_ref, out=walk.X_ref)
        X, X_ref = walk.X, walk.X_ref
        packed, residuals = {}, {}  # residuals: where each weight sat between its levels (--tune-rounding)
        ref_weights = _linear_weights(block, groups) if calib.fp_target else None  # unquantized
        quantize_group = functools.partial(_quantize_group, walk, i, packed, residuals, ref_weights)
        X_in = X.clone() if sequential and tune.steps else X  # tuning needs the block's input
        if sequential:  # one staged pass per stream: each group calibrated after the groups before it
            stats = calibrate_in_stages(model, i, X, quantize_group, X_ref if calib.fp_target else None, ref_weights)
            for name, qw in packed.items() if scheme.method == "awq" else ():  # a rescaled packed producer
                block.get_submodule(name).weight.data = qw.dequantize(dtype)  # holds what is saved
        else:
            # All groups at once: stop at the last one's input (down_proj's), past the attention and its K/V ranges.
            # (RTN reads no statistics: its X is there for the K/V ranges or tuning, each measured below)
            needs_stats = X is not None and scheme.method in ("gptq", "awq")
            stats = capture_block(model, i, X, groups, partial=True) if needs_stats else None
            if scheme.method == "awq":
                apply_awq(model, i, stats, scheme)
            for g in range(len(groups)):
                quantize_group(g, stats.linears if stats is not None else {})
            if scheme.kv_cache != "none" and not tune.steps:  # (tuning measures them below)
                stats = capture_block(model, i, X, ())  # the K/V ranges of the quantized q/k/v, as stored
        if tune.steps:
            packed, result = tune_block(model, i, packed, X_in, X_ref, tune, residuals)
            report.tune_losses[f"model.layers.{i}"] = (result.loss_before, result.loss_after)
            if result.discarded:
                report.tune_discarded.append(f"model.layers.{i}")
            if result.best_step is not None:
                report.tune_best_steps[f"model.layers.{i}"] = result.best_step
                report.tune_held_out[f"model.layers.{i}"] = [list(c) for c in result.held_out]
            if scheme.kv_cache != "none":  # the tuned q/k norms move the keys: measure the ranges again
                stats = capture_block(model, i, X_in, groups)
        walk.quantized.update({f"model.layers.{i}.{name}": qw for name, qw in packed.items()})
        if stats is not None:
            _kv_scales(walk.tensors, i, stats, scheme)
        if X is not None and (not sequential or tune.steps):  # (a staged pass leaves X at the block's output)
            walk.X = run_block(model, i, X_in, out=X)
        for stream in (walk.X, X_ref):  # a model that overflows stops here, not at NaN scales or a NaN tuning KL
            if stream is not None and not bool(torch.isfinite(stream).all()):
                raise QinferError(f"model.layers.{i}: its output contains NaN or Inf: {ACTIVATIONS_OVERFLOW}")
    _block_tensors(walk.tensors, model, i)  # norms (maybe AWQ-rescaled) go back in the model dtype
    if not tune.e2e_steps:  # done with this block: release its weights (end-to-end tuning needs them all)
        model.model.layers[i] = torch.nn.Identity()
        drop_pages(loaded)  # nothing reads them again but the saved norms (faulted back in from the file)
    del block, loaded
    return_freed_memory()


def _quantize_group(walk: _Walk, i: int, packed: dict, residuals: dict, ref_weights: dict | None, g: int,
                    linears: dict) -> None:
    """Quantize linear group ``g`` of block ``i`` (linears that read one input: q/k/v, o, gate/up, down) on its
    input statistics ``linears``, into ``packed``; the block then computes with the quantized weights, so later
    groups and blocks see them."""
    scheme, calib, arch, report = walk.scheme, walk.calib, walk.model.config.arch, walk.report
    block = walk.model.model.layers[i]
    names = walk.groups[g]
    s = linears.get(names[0])  # the group's linears read one input: one set of statistics
    weights = {name: block.get_submodule(name).weight.data.float() for name in names}
    if s is not None and s.D is not None:  # --fp-target: aim at the unquantized model's output
        weights = {name: fp_target(W, s.H, s.D, calib.fp_target_damp, name=f"model.layers.{i}.{name}")
                   for name, W in weights.items()}
    H, pending = None if s is None else s.H, None
    if scheme.method == "awq" and calib.true_sequential:  # scales searched on these inputs and weights
        scaled = scale_group(block, arch.linear_groups[g], weights, s, scheme, arch.norm_offset, packed,
                             ref_weights, prefix=f"model.layers.{i}.")
        weights, H, pending = scaled.weights, scaled.gram, scaled.pending
    for name, W in weights.items():
        prefix = f"model.layers.{i}.{name}"
        packed[name], report.layer_errors[prefix] = _quantize_linear(W, H, scheme, prefix, report.raised_damping)
        if walk.tune.rounding:
            residuals[name] = rounding_residual(W, packed[name])
        weight = packed[name].dequantize(torch.float32)  # later groups and blocks see it quantized
        block.get_submodule(name).weight.data = (weight if pending is None else weight / pending).to(walk.dtype)


def _tune_end_to_end(walk: _Walk) -> None:
    """Tune every group scale and norm on the KL to the unquantized model's next-token distribution; then measure
    the K/V ranges (and the lm_head's input) again, which the tuned norms moved."""
    model, scheme, report, dtype = walk.model, walk.scheme, walk.report, walk.dtype
    walk.quantized, result = tune_end_to_end(model, walk.quantized, walk.ids, model.model.norm(walk.X_ref), walk.tune)
    report.e2e_kl, report.e2e_samples = (result.loss_before, result.loss_after), min(len(walk.ids), E2E_EVAL_SAMPLES)
    report.e2e_discarded = result.discarded
    for i in range(model.config.num_layers):
        _block_tensors(walk.tensors, model, i)
    if scheme.kv_cache != "none" or _head_scheme(scheme).method == "gptq":
        X = walk.X = embed_samples(model, walk.ids, dtype)
        for i in range(model.config.num_layers):
            with block_in(model.model.layers[i], dtype, back=model.dtype):
                if scheme.kv_cache != "none":
                    _kv_scales(walk.tensors, i, capture_block(model, i, X, ()), scheme)
                X = walk.X = run_block(model, i, X, out=X)


def _collect(walk: _Walk) -> None:
    """Everything else the folder holds: the packed linears, the embedding (unless read from a quantized tied
    lm_head), the final norm, a stored BOS position, the lm_head (quantized on the final activations if asked)."""
    model, scheme, report, tensors = walk.model, walk.scheme, walk.report, walk.tensors
    for name, qw in walk.quantized.items():
        _account(report, tensors, qw, name, qw.shape[0] * qw.shape[1])
    walk.X_ref = None
    if scheme.quantize_lm_head and model.tied:
        report.embedding_bits = scheme.lm_head_bits  # read from the quantized lm_head (qinfer.format)
    else:
        tensors["model.embed_tokens.weight"] = model.model.embed_tokens.weight.contiguous()
    tensors["model.norm.weight"] = model.model.norm.weight.contiguous()
    if walk.bos is not None:
        tensors.update(bos_tensors(walk.bos))
    report.kept_bos = walk.bos is not None
    _lm_head(model, walk.X, scheme, tensors, report)
    walk.X = None


def _save(walk: _Walk, folder: Path, out: Path, force: bool, start: float) -> QuantizeReport:
    """Write OUT in one rename: weights, config, the source's tokenizer files, quant_config.json and the report."""
    report = walk.report
    with atomic_dir(out, force=force) as tmp:
        save_tensors(walk.tensors, tmp / "model.safetensors")
        _write_config(folder, tmp, walk.model.dtype, walk.model.tied)
        for name in SIDE_FILES:  # unchanged, so OUT is a complete model folder
            if (folder / name).exists():
                shutil.copy2(folder / name, tmp / name)
        walk.scheme.save(tmp)
        report.bytes_after = _folder_bytes(tmp)
        report.seconds = time.perf_counter() - start
        report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # inside the temp folder: OUT appears with its report, never without
        record = _report_json(report, walk.scheme, walk.calib, walk.tune, source_identity(folder))
        (tmp / "quantize_report.json").write_text(json.dumps(record, indent=2))
    return report


def _write_config(folder: Path, out: Path, dtype: torch.dtype, tied: bool) -> None:
    """``folder``'s config.json in ``out``, its ``dtype`` / ``torch_dtype`` saying ``dtype`` (the embedding's and
    the other unquantized tensors', whatever the source held: an fp32 model is stored in bf16), and
    ``tie_word_embeddings`` false wherever the lm_head is a table of its own (a source may store one despite
    the key: see ``qinfer.model.loader``)."""
    config = json.loads((folder / "config.json").read_text())
    if not tied:  # (where the key is left out, Gemma 3's default would tie them)
        config["tie_word_embeddings"] = False
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]:
        config[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _own_bos(model: Transformer, ids: torch.Tensor | None) -> BosState | None:
    """What the unquantized model computes at the BOS position, if it has a BOS token and every calibration
    sample starts with it (else None: calibration could not leave that position out of its statistics)."""
    bos = model.config.bos_token_id
    if bos is None or (ids is not None and not bool((ids[:, 0] == bos).all())):
        return None
    return model.own_bos()


def _linear_weights(block: torch.nn.Module, groups: tuple[tuple[str, ...], ...]) -> dict[str, torch.Tensor]:
    """The block's linear weights as they are now (the tensors, not copies: quantizing replaces them)."""
    return {name: block.get_submodule(name).weight.data for group in groups for name in group}


def _quantize_linear(W: torch.Tensor, H: torch.Tensor | None, scheme: QuantScheme, name: str,
                     raised_damping: dict[str, float] | None = None):
    """(packed weight, output error proxy) for one linear; a damping GPTQ had to raise goes into ``raised_damping``."""
    if scheme.method == "gptq":  # integer or FP8 grid
        result = gptq_quantize_ex(W, H, scheme, name=name)
        if result.damp > scheme.damp and raised_damping is not None:
            raised_damping[name] = max(result.damp, raised_damping.get(name, 0.0))
        return result.weight, result.error
    if scheme.format == "fp8":
        qw = fp8_quantize(W, scheme, name=name)
    else:
        qw = rtn_quantize(W, scheme, name=name)
    err = float(((qw.dequantize(torch.float32) - W.float()) ** 2).sum()) if H is None else float(
        torch.einsum("nk,kl,nl->", d := qw.dequantize(torch.float32) - W.float(), H, d)
    )
    return qw, err


def _kv_scales(tensors: dict, i: int, stats, scheme: QuantScheme) -> None:
    if scheme.kv_cache != "none":
        to_scale = int8_kv_scale if scheme.kv_cache == "int8" else fp8_kv_scale
        for kv in "kv":
            absmax = stats.k_absmax if kv == "k" else stats.v_absmax
            name = f"model.layers.{i}.self_attn.{kv}_proj: output range"
            tensors[f"model.layers.{i}.self_attn.{kv}_scale"] = to_scale(absmax, name).float()


def _block_tensors(tensors: dict, model: Transformer, i: int) -> None:
    """Block ``i``'s unquantized tensors (its norms, and its linears' biases, Qwen2's q/k/v) into ``tensors``."""
    packed = {f"{n}.weight" for n in model.config.arch.linear_names}
    for name, t in model.model.layers[i].state_dict().items():
        if name not in packed:
            tensors[f"model.layers.{i}.{name}"] = t.contiguous()


def _account(report: QuantizeReport, tensors: dict, qw, prefix: str, n_weights: int) -> None:
    packed = qw.tensors(prefix)
    tensors.update(packed)
    report.quantized_params += n_weights
    report.quantized_bits += sum(t.numel() * t.element_size() * 8 for t in packed.values())


def _lm_head(model: Transformer, X: torch.Tensor | None, scheme: QuantScheme, tensors: dict, report) -> None:
    W = model.lm_head.weight.data
    if not scheme.quantize_lm_head:
        if not model.tied:
            tensors["lm_head.weight"] = W.contiguous()
        return
    head_scheme = _head_scheme(scheme)
    H = None
    if X is not None and head_scheme.method == "gptq":  # (a stored BOS position's logits are not the head's)
        h = model.model.norm(X[:, first_kept(model):]).reshape(-1, X.shape[-1])
        H = (h.T @ h).float()
    qw, err = _quantize_rows(W, H, head_scheme, "lm_head", raised_damping=report.raised_damping)
    # AWQ's per-channel scales would fold into the final norm, which every position's logits share: to nearest
    report.lm_head_method = "gptq" if H is not None else "fp8" if head_scheme.format == "fp8" else "rtn"
    report.layer_errors["lm_head"] = err
    _account(report, tensors, qw, "lm_head", W.numel())


def _head_scheme(scheme: QuantScheme) -> QuantScheme:
    """The scheme the lm_head is quantized with: ``scheme.lm_head_scheme()``, but an 8-bit integer head is rounded to
    nearest on its groups' min/max. There GPTQ with the clip search buys nothing measurable (gemma3-270m's GPTQ 4-bit
    model: KL to the reference 0.0770 with a GPTQ head, 0.0771 rounded, 0.0768 with the bf16 head, on 8192 held-out
    tokens; docs/results.md, "The lm_head in 8 and 4 bits") and costs minutes on a 262k-row head."""
    head = scheme.lm_head_scheme()
    if head.format == "int" and head.bits == 8:
        return replace(head, method="rtn", mse_clip=False, act_order=False)
    return head


def _quantize_rows(W: torch.Tensor, H: torch.Tensor | None, scheme: QuantScheme, name: str, rows: int = LM_HEAD_ROWS,
                   raised_damping: dict[str, float] | None = None):
    """``_quantize_linear`` over ``rows`` output rows at a time: every quantizer here treats rows independently
    given ``H`` (GPTQ's error feedback runs along a row), so only a slice is ever in fp32, not the whole
    [vocab, hidden] lm_head (several fp32 copies of gemma3's run to gigabytes). A per-tensor FP8 scale spans
    all rows, so that weight is quantized whole."""
    if W.shape[0] <= rows or (scheme.format == "fp8" and scheme.fp8_granularity == "tensor"):
        return _quantize_linear(W.float(), H, scheme, name, raised_damping)
    parts = [_quantize_linear(W[r : r + rows].float(), H, scheme, name, raised_damping)
             for r in range(0, W.shape[0], rows)]
    weights = [w for w, _ in parts]
    error = sum(e for _, e in parts)
    if isinstance(weights[0], Fp8Weight):
        return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights])), error
    zero = None if weights[0].zero is None else torch.cat([w.zero for w in weights])
    qweight, scale = torch.cat([w.qweight for w in weights]), torch.cat([w.scale for w in weights])
    return replace(weights[0], qweight=qweight, scale=scale, zero=zero, shape=tuple(W.shape)), error


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(folder))


def source_identity(folder: Path) -> dict:
    """What quantize_report.json records of the source model: its folder, and the size and modification time of
    each file there (weights, config, tokenizer), so a cached quantization of a model since re-pulled or edited is
    told apart from a current one (the main job's)."""
    files = sorted(f for f in Path(folder).iterdir() if f.is_file() and not f.name.startswith("."))
    return {"folder": str(Path(folder).resolve()),
            "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def _report_json(report: QuantizeReport, scheme: QuantScheme, calib: CalibConfig, tune: TuneConfig,
                 source: dict) -> dict:
    return {
        "scheme": json.loads(scheme.to_json()),
        "calibration": recorded_calibration(scheme, calib, tune),
        "calibration_text_tokens": report.calibration_text_tokens,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "effective_bits": report.effective_bits,
        "seconds": report.seconds,
        "peak_rss_bytes": report.peak_rss_bytes,
        "layer_errors": report.layer_errors,
        "raised_damping": report.raised_damping,
        "tuning": tune.__dict__,
        "tune_losses": report.tune_losses,
        "tune_discarded": report.tune_discarded,
        "tune_best_steps": report.tune_best_steps,
        "tune_held_out": report.tune_held_out,
        "e2e_kl": report.e2e_kl,
        "e2e_discarded": report.e2e_discarded,
        "embedding_bits": report.embedding_bits,
        "lm_head_method": report.lm_head_method,
        "compute_dtype": report.compute_dtype,
        "kept_bos": report.kept_bos,
        "code": code_fingerprint(),
        "source": source,
    }
