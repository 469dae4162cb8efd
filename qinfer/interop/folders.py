"""Whole checkpoints: export a qinfer-quantized folder as a GPTQ (v1) or compressed-tensors folder, and import
such a folder into the qinfer format.

A foreign folder is recognised by the ``quantization_config`` entry of its ``config.json`` (the key GPTQModel,
AutoGPTQ, llm-compressor and vLLM use), or, for older AutoGPTQ checkpoints, by a ``quantize_config.json`` beside
it (GPTQ; vLLM and GPTQModel read that too). The per-linear layouts are :mod:`qinfer.interop.gptq` and
:mod:`qinfer.interop.compressed_tensors`; this module finds the linears, carries every other tensor (norms,
embeddings, biases, an unquantized lm_head, linears a foreign checkpoint left unquantized) through unchanged, and
writes the config and tokenizer files. A
quantized lm_head is exported untied (``tie_word_embeddings: false``), with the embedding table qinfer reads
from it written out in bf16 (qinfer computing in fp32 reads it unrounded, so an fp32 reader of the export sees
embeddings that differ by that rounding); importing such an export ties them again.
Both directions write atomically (temp folder + rename).

KV-cache scales (``self_attn.k_scale`` / ``v_scale``, qinfer's per KV head and channel) have no place in the GPTQ
layout: that export leaves them out and says so. The compressed-tensors export writes them in the form of
llm-compressor's static FP8 ``kv_cache_scheme`` (``FP8_KV_CACHE_SCHEME``), one per tensor: the largest calibrated
absmax over 448 (int8-calibrated scales are the same absmax over 127), which vLLM's ``--kv-cache-dtype fp8``
reads; the finer scales are not kept. The other way, a compressed-tensors checkpoint's static 8-bit
``kv_cache_scheme`` scales are imported, each repeated for every KV head, and ``kv_cache`` records their dtype.
Not carried across: a stored BOS position (``self_attn.bos_k`` / ``bos_v``,
``model.bos_hidden``: qinfer.format), which no other reader applies: there the exported model computes the BOS
position with its quantized weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qinfer.model.arch import ModelConfig, read_config
from qinfer.store.atomic import atomic_dir, check_output, save_tensors
from qinfer.store.manifest import damage, write_manifest
from qinfer.errors import QinferError
from qinfer.store.reading import read_json_object
from qinfer.format import QUANT_CONFIG_FILE, QuantScheme, packed_weight
from qinfer.interop import compressed_tensors as ct
from qinfer.interop import gptq
from qinfer.model.kv_cache import QMAX, check_scale

EXPORT_FORMATS = ("gptq", "compressed-tensors")
AUTOGPTQ_CONFIG_FILE = "quantize_config.json"
IMPORT_METHODS = (gptq.CHECKPOINT_FORMAT, ct.QUANT_METHOD)
# Part of an imported copy's cache key: raised when an import writes something else for the same folder (2: the
# quantized lm_head read from the tensors, not from compressed-tensors' ignore list), so older copies are made again.
IMPORT_REVISION = b"2"
# Besides config.json and the weights, what makes a folder a usable model.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass
class ConvertReport:
    out: Path
    linears: int = 0
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # for the user: what a reader of the output should know


def foreign_quant_config(folder: Path, config: dict | None = None) -> dict | None:
    """``folder``'s quantization config: ``quantization_config`` of its ``config.json`` (``config``, when the
    caller has read it), else an older AutoGPTQ ``quantize_config.json`` beside it (GPTQ; vLLM and GPTQModel read
    it too), else None (not quantized)."""
    folder = Path(folder)
    q = (read_config(folder) if config is None else config).get("quantization_config")
    if q is None and (folder / AUTOGPTQ_CONFIG_FILE).is_file():
        old_style = read_json_object(folder / AUTOGPTQ_CONFIG_FILE, "fix or remove it")
        q = {"quant_method": gptq.CHECKPOINT_FORMAT, **old_style}
    if q is not None and not isinstance(q, dict):
        raise QinferError(f"{folder}/config.json: quantization_config is not a JSON object")
    return q


def foreign_quant_method(folder: Path) -> str | None:
    """``quant_method`` of :func:`foreign_quant_config`, or None when the folder declares no quantization."""
    q = foreign_quant_config(folder)
    return None if q is None else str(q.get("quant_method"))


def export_folder(src: Path, out: Path, fmt: str, force: bool = False) -> ConvertReport:
    """Write the qinfer-quantized folder ``src`` to ``out`` in ``fmt`` ("gptq" or "compressed-tensors")."""
    from qinfer.model.loader import is_bos_tensor, read_folder_tensors

    src, out = Path(src), Path(out)
    if fmt not in EXPORT_FORMATS:
        raise QinferError(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if not (src / QUANT_CONFIG_FILE).exists():
        raise QinferError(f"{src} is not a qinfer-quantized folder (no {QUANT_CONFIG_FILE}): run qinfer quantize first")
    check_output(out, force, source=src)
    scheme = QuantScheme.load(src)
    config = read_config(src)
    if fmt == "gptq" and scheme.format == "fp8":
        raise QinferError(f"{src}: FP8 weights have no GPTQ layout: export with --format compressed-tensors")
    if fmt == "gptq":
        quantization_config = gptq.gptq_quantization_config(scheme)
    else:
        quantization_config = ct.compressed_tensors_config(scheme)
    tensors = read_folder_tensors(src)
    report = ConvertReport(out)
    result, head, act_order = {}, None, False
    prefixes = sorted({k.rsplit(".", 1)[0] for k in tensors})
    for prefix in prefixes:
        weight = packed_weight(prefix, tensors, scheme.lm_head_scheme() if prefix == "lm_head" else scheme)
        if weight is None:
            continue
        if prefix == "lm_head":
            head = weight
        act_order |= getattr(weight, "perm", None) is not None
        for key in weight.tensors(prefix):
            tensors.pop(key)
        if fmt == "gptq":
            result.update(gptq.to_gptq_tensors(weight, prefix))
        else:
            result.update(ct.to_compressed_tensors(weight, prefix))
        report.linears += 1
    dense = _dense_linears(tensors, ModelConfig.from_dict(config).arch.linear_names)
    if fmt == "gptq":
        if dense:
            raise QinferError(
                f"{src}: {dense[0]} is not quantized ({len(dense)} linears are not; an imported checkpoint left them "
                "out), which a GPTQ v1 config cannot say: export with --format compressed-tensors"
            )
        quantization_config["lm_head"] = head is not None
    else:  # what is not quantized: the lm_head unless it is, and any linear a checkpoint imported left out
        quantization_config["ignore"] = (["lm_head"] if head is None else []) + dense
    if head is not None:  # a quantized lm_head is a tensor of its own for other readers: untied
        config["tie_word_embeddings"] = False
        if "model.embed_tokens.weight" not in tensors:  # qinfer's tied embedding (qinfer.format): a bf16 table
            tensors["model.embed_tokens.weight"] = head.dequantize(torch.bfloat16)
    kv_scales = {name: tensors.pop(name) for name in list(tensors)
                 if name.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
    if kv_scales and fmt != "gptq" and scheme.kv_cache in QMAX:
        for name, scale in kv_scales.items():  # one per tensor, as FP8's: amax / 448
            result[name] = (scale.float().amax() * (QMAX[scheme.kv_cache] / QMAX["fp8"])).reshape(1)
        quantization_config["kv_cache_scheme"] = dict(ct.FP8_KV_CACHE_SCHEME)
        report.notes.append(f"KV-cache scales written per tensor for an FP8 cache (kv_cache_scheme, as vLLM's "
                            f"--kv-cache-dtype fp8 reads them): {len(kv_scales) // 2} layers' keys and values, "
                            "each its largest calibrated absmax over 448 (the finer scales are not kept)")
    else:
        report.dropped.extend(kv_scales)
    for name in list(tensors):
        if is_bos_tensor(name):
            report.dropped.append(name)
            tensors.pop(name)
    result.update(tensors)
    if act_order:  # groups that are not contiguous (compressed-tensors refused them above): follow g_idx
        quantization_config["desc_act"] = True
    config["quantization_config"] = quantization_config
    _write(src, out, result, config, force)
    bos = [n for n in report.dropped if is_bos_tensor(n)]
    if len(bos) < len(report.dropped):
        layers = (len(report.dropped) - len(bos)) // 2
        report.notes.append(f"KV-cache scales ({layers} layers' keys and values) are not part of the {fmt} layout "
                            "and were left out")
    if bos:
        report.notes.append(f"the stored BOS position (keys, values, output) is not part of the {fmt} layout and was "
                            "left out")
    if fmt != "gptq" and scheme.format == "int" and scheme.bits not in (4, 8):
        report.notes.append(
            f"vLLM runs compressed-tensors integer weights of 4 and 8 bits only (its GPTQ kernels also 2 and 3): "
            f"this {scheme.bits}-bit checkpoint is for the compressed-tensors library (llm-compressor, transformers)"
        )
    if fmt != "gptq" and scheme.format == "int" and not scheme.symmetric:
        report.notes.append(
            "asymmetric weights: transformers (5.24, with compressed-tensors 0.20) cannot load them yet (a size "
            "mismatch on weight_zero_point, llm-compressor issue 1618), though the compressed-tensors library reads "
            "them; for transformers quantize with --sym"
        )
    return report


def import_folder(src: Path, out: Path, force: bool = False) -> ConvertReport:
    """Convert a GPTQ (v1) or compressed-tensors folder ``src`` into a qinfer-quantized folder ``out``."""
    from qinfer.model.loader import read_folder_tensors

    src, out = Path(src), Path(out)
    config = read_config(src)
    qconfig = foreign_quant_config(src, config) or {}
    method = qconfig.get("quant_method")
    if method not in IMPORT_METHODS:
        raise QinferError(
            f"{src}: quantization_config.quant_method {method!r} is not supported; qinfer reads "
            f"{' and '.join(IMPORT_METHODS)} checkpoints (or unquantized ones)"
        )
    config.pop("quantization_config", None)
    if method == gptq.CHECKPOINT_FORMAT:
        scheme = gptq.scheme_from_gptq_config(qconfig)
    else:
        scheme = ct.scheme_from_compressed_tensors_config(qconfig)
    tensors = read_folder_tensors(src)
    report = ConvertReport(out)
    result, head = {}, None
    prefixes = _foreign_prefixes(tensors, method)
    if ("lm_head" in prefixes) != scheme.quantize_lm_head:  # the tensors say it (an ignore entry may be a pattern)
        quantized = "lm_head" in prefixes
        scheme = dataclasses.replace(scheme, quantize_lm_head=quantized, lm_head_bits=scheme.bits if quantized else 8)
    for prefix in prefixes:
        s = scheme.lm_head_scheme() if prefix == "lm_head" else scheme
        weight = gptq.from_gptq_tensors(prefix, tensors, s) if method == gptq.CHECKPOINT_FORMAT else (
            ct.from_compressed_tensors(prefix, tensors, s)
        )
        head = weight if prefix == "lm_head" else head
        for suffix in _FOREIGN_SUFFIXES[method]:
            tensors.pop(f"{prefix}.{suffix}", None)
        result.update(weight.tensors(prefix))
        report.linears += 1
    if report.linears == 0:
        raise QinferError(f"{src}: config.json declares {method} quantization but no quantized weights were found")
    embed = tensors.get("model.embed_tokens.weight")
    if (head is not None and embed is not None and embed.dtype == torch.bfloat16
            and torch.equal(embed, head.dequantize(torch.bfloat16))):
        # qinfer's own export of a tied embedding (above): tie it again, so that the table is read from the
        # lm_head in every compute dtype, as before the export, not from its bf16 rounding.
        del tensors["model.embed_tokens.weight"]
        config["tie_word_embeddings"] = True
    kv = ct.kv_cache_dtype(qconfig) if method == ct.QUANT_METHOD else "none"
    _kv_scales_per_head(src, tensors, kv, ModelConfig.from_dict(config).num_kv_heads)
    result.update(tensors)
    _write(src, out, result, config, force, dataclasses.replace(scheme, kv_cache=kv))
    return report


def _kv_scales_per_head(src: Path, tensors: dict[str, torch.Tensor], kv: str, n_kv: int) -> None:
    """Turn a compressed-tensors checkpoint's KV-cache scales (per tensor: one value, 0-d or [1]; or one per KV
    head) into qinfer's, one fp32 value per KV head, in place. Both are amax over the largest code of ``kv``."""
    names = [k for k in tensors if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    if names and kv == "none":
        raise QinferError(f"{src}: {names[0]} and other KV-cache scales, but quantization_config has no static "
                          "kv_cache_scheme saying which cache dtype they scale: add one, or remove the scales")
    if kv != "none" and not names:
        raise QinferError(f"{src}: quantization_config's kv_cache_scheme is static but there are no k_scale/v_scale "
                          "tensors: the checkpoint is incomplete")
    for name in names:
        t = tensors[name].float().reshape(-1)
        if t.numel() not in (1, n_kv):
            raise QinferError(f"{src}: {name} has {t.numel()} values; qinfer reads one per tensor or one per KV "
                              f"head ({n_kv})")
        partner = name[: -len("k_scale")] + ("v_scale" if name.endswith("k_scale") else "k_scale")
        if partner not in tensors:
            raise QinferError(f"{src}: {name} has no {partner.rsplit('.', 1)[1]} beside it: the checkpoint is incomplete")
        check_scale(src, name, t, "the checkpoint's KV-cache scales are damaged; calibrate them again")
        tensors[name] = t.expand(n_kv).clone()


def imported_copy(src: Path, cache: Path) -> Path:
    """The qinfer-format conversion of the foreign folder ``src`` under ``cache``, made on first use.

    Keyed by :data:`IMPORT_REVISION`, the config (and an AutoGPTQ ``quantize_config.json``), the tokenizer and
    generation files copied beside the weights, and the size, modification time and first megabyte of each weight
    file.
    """
    from qinfer.model.loader import load_model, weight_files

    src = Path(src)
    h = hashlib.sha256(IMPORT_REVISION + (src / "config.json").read_bytes())
    for name in (*SIDE_FILES, AUTOGPTQ_CONFIG_FILE):
        h.update(name.encode() + ((src / name).read_bytes() if (src / name).is_file() else b"\0absent"))
    for f in weight_files(src):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    target = cache / "converted" / f"{src.resolve().name}-{h.hexdigest()[:16]}"
    if not (target / QUANT_CONFIG_FILE).exists() or damage(target):
        import_folder(src, target, force=True)
        try:  # a conversion the loader refuses (a tensor too many or too few) is not kept, and names src
            load_model(target, device="meta")
        except QinferError as e:
            shutil.rmtree(target, ignore_errors=True)
            raise QinferError(str(e).replace(str(target), str(src))) from None
        write_manifest(target)
    return target


_FOREIGN_SUFFIXES = {
    gptq.CHECKPOINT_FORMAT: ("qweight", "qzeros", "scales", "g_idx"),
    ct.QUANT_METHOD: ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight"),
}


def _dense_linears(tensors: dict[str, torch.Tensor], linear_names: tuple[str, ...]) -> list[str]:
    """The decoder linears ``tensors`` holds unquantized (``P.weight`` of a floating dtype), in layer order."""
    found = []
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        parts = prefix.split(".", 3)  # model, layers, i, self_attn.q_proj
        if (prefix != name and len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and parts[3] in linear_names and t.dtype != torch.float8_e4m3fn):
            found.append((int(parts[2]), linear_names.index(parts[3]), prefix))
    return [prefix for *_, prefix in sorted(found)]


def _foreign_prefixes(tensors: dict[str, torch.Tensor], method: str) -> list[str]:
    if method == gptq.CHECKPOINT_FORMAT:
        return sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight"))
    packed = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    fp8 = [
        k.removesuffix(".weight")
        for k, t in tensors.items()
        if k.endswith(".weight") and t.dtype == torch.float8_e4m3fn
    ]
    return sorted(packed + fp8)


def _write(src: Path, out: Path, tensors: dict, config: dict, force: bool, scheme: QuantScheme | None = None) -> None:
    with atomic_dir(out, force=force) as tmp:
        save_tensors({k: t.contiguous() for k, t in tensors.items()}, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in SIDE_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
        if scheme is not None:
            scheme.save(tmp)
