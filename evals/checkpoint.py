"""What a model folder holds, read without loading it: a content key, its size on disk, bits per weight; and the
diagnostics' checks that a folder is a quantized copy of a reference (``check_same_model``, ``check_quantized``).

``content_key`` identifies a folder's model for the eval cache. Hashing 500 MB of weights would read every
byte of every model on every run, so it hashes what changes whenever the weights do: the bytes of
``config.json`` and ``quant_config.json``, each safetensors file's header (tensor names, dtypes, shapes,
offsets), and every file's name, size, modification time and status-change time (ctime, which the kernel
sets on every write and no tool can set back: a file rewritten and then given its old mtime, by ``touch -r``
or a copy that keeps times, still changes the key). Re-quantizing a folder rewrites its files, so it gets a
new key; a copied folder gets a new key too, which costs one recomputation and is never wrong. The files
``qinfer eval`` itself writes (``--out`` may be the model's folder) are left out.

``effective_bits`` is the stored bits per weight over the linears qinfer quantizes, the decoder blocks'
linears named by the architecture table (plus the lm_head when it is stored quantized), counted from the
safetensors headers: packed codes, scales and zeros all included, so a bf16 checkpoint gives exactly 16
and RTN 4-bit g128 with fp16 scales 4.125. Weight counts come from the stored shapes (a packed
``qweight`` ``[N, K * bits / 8]`` holds ``N * K`` weights).
"""

import dataclasses
import hashlib
import json
from pathlib import Path

from qinfer.model.arch import ModelConfig
from qinfer.errors import QinferError
from qinfer.evals.report import REPORT_FILES
from qinfer.format import QUANT_CONFIG_FILE, QuantScheme
from qinfer.model.loader import safetensors_header, weight_files

_WEIGHT_KEYS = ("weight", "qweight", "scale", "zero", "perm")  # a linear's stored weight; its bias is not a weight
_HASHED_FILES = ("config.json", QUANT_CONFIG_FILE)


def content_key(folder: Path) -> str:
    """A sha256 hex digest that changes whenever the folder's model does (see the module docstring)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for name in _HASHED_FILES:
        path = folder / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"<absent>") + b"\0")
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in REPORT_FILES):
        stat = path.stat()
        h.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0".encode())
    for path in weight_files(folder):
        h.update(json.dumps(safetensors_header(path)[0], sort_keys=True).encode())
    return h.hexdigest()


def size_on_disk(folder: Path) -> int:
    """Bytes of the folder's safetensors files."""
    return sum(path.stat().st_size for path in weight_files(folder))


def effective_bits(folder: Path) -> float:
    """Stored bits per weight over the quantizable linears (see the module docstring)."""
    folder = Path(folder)
    header = _header(folder)
    config = ModelConfig.from_folder(folder)
    scheme = QuantScheme.load(folder) if (folder / QUANT_CONFIG_FILE).exists() else None
    prefixes = [f"model.layers.{i}.{name}" for i in range(config.num_layers) for name in config.arch.linear_names]
    if "lm_head.qweight" in header or "lm_head.scale" in header:
        prefixes.append("lm_head")
    bits = weights = 0
    for prefix in prefixes:
        if f"{prefix}.qweight" in header:  # packed integer codes: [N, K * b / 8]
            b = scheme.lm_head_bits if prefix == "lm_head" else scheme.bits
            N, packed = header[f"{prefix}.qweight"]["shape"]
            n_weights = N * packed * 8 // b
        elif f"{prefix}.weight" in header:  # dense or fp8: [N, K]
            N, K = header[f"{prefix}.weight"]["shape"]
            n_weights = N * K
        else:
            raise QinferError(f"{folder}: no stored weight for {prefix}")
        for key in _WEIGHT_KEYS:
            if f"{prefix}.{key}" in header:
                start, end = header[f"{prefix}.{key}"]["data_offsets"]
                bits += 8 * (end - start)
        weights += n_weights
    return bits / weights


def check_same_model(reference: Path, quantized: Path) -> None:
    """Refuse a pair of folders whose configs describe different decoders (the diagnostics swap and compare
    their blocks one for one): a quantized model keeps its source's config."""
    a, b = ModelConfig.from_folder(reference), ModelConfig.from_folder(quantized)
    if a != b:
        differ = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
        raise QinferError(f"{quantized} is not a quantized copy of {reference}: their configs differ in "
                          f"{', '.join(differ)}; give the model it was quantized from")


def check_quantized(folder: Path, label: str) -> None:
    """Refuse a folder that stores no quantized linear (packed integer codes ``P.qweight``, or FP8 weights with
    their ``P.scale``; see :mod:`qinfer.format`): the reference itself or another unquantized copy, which the
    diagnostics would find equal to the reference everywhere. ``label`` names it as the user gave it."""
    header = _header(Path(folder))
    packed = any(name.endswith(".qweight") or (info["dtype"] == "F8_E4M3" and f"{name.removesuffix('.weight')}.scale"
                                                in header) for name, info in header.items())
    if not packed:
        raise QinferError(f"{label} holds no quantized linear: it is the reference or an unquantized copy; give the "
                          "model qinfer quantize wrote")


def _header(folder: Path) -> dict[str, dict]:
    """The safetensors headers of the folder's weight files, merged: tensor name -> dtype, shape, offsets."""
    header: dict[str, dict] = {}
    for path in weight_files(folder):
        header.update(safetensors_header(path)[0])
    return header
