"""Turn a MODEL argument into a local Hugging Face-style folder.

Accepted: a built-in name (pulled on first use), a folder with config.json + *.safetensors (a user's HF
checkpoint or a qinfer-quantized one), a GPTQ (v1) or compressed-tensors folder (converted once into the
qinfer format in the cache), or a .gguf file (converted once into the cache, keyed by its size, time and ends).
"""

import functools
import hashlib
import sys
from pathlib import Path

from qinfer.store.atomic import atomic_dir
from qinfer.store.manifest import damage, write_manifest
from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError
from qinfer.format import QUANT_CONFIG_FILE
from qinfer.interop.folders import foreign_quant_method, imported_copy
from qinfer.sources.registry import BUILTINS, pull


def resolve_model(spec: str) -> Path:
    if not spec.strip():  # Path("") is the working directory: not what an empty argument meant
        raise QinferError(f"the model is {spec!r}, empty: give a model folder, a .gguf file or a built-in name "
                          f"({', '.join(BUILTINS)})")
    if spec in BUILTINS:
        if Path(spec).exists():
            _shadow_note(spec)
        return pull(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise QinferError(f"{path} is not a model folder: it has no config.json")
        if not any(path.glob("*.safetensors")):
            raise QinferError(f"{path} has no *.safetensors weights: qinfer reads safetensors checkpoints only")
        if not (path / QUANT_CONFIG_FILE).exists() and foreign_quant_method(path) is not None:
            return imported_copy(path, cache_dir())
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _converted_gguf(path)
        raise QinferError(f"{path} is neither a model folder nor a .gguf file")
    if "/" in spec or spec.endswith(".gguf") or spec.startswith("."):
        raise QinferError(f"{spec}: no such file or folder; give a model folder, a .gguf file or a built-in name "
                          f"({', '.join(BUILTINS)})")
    raise QinferError(
        f"unknown model {spec!r}: not a built-in ({', '.join(BUILTINS)}), a model folder, or a .gguf file"
    )


@functools.cache  # once per process: eval resolves each MODEL more than once
def _shadow_note(spec: str) -> None:
    print(f"note: {spec!r} is the built-in model; the {spec} here is not read (write ./{spec} for it)",
          file=sys.stderr)


def _converted_gguf(path: Path) -> Path:
    # Key the conversion by size, modification time and a hash of the head and tail: cheap, and a changed file
    # gets a new folder (also one changed in the middle only, whose head and tail stay: its time moves)
    st = path.stat()
    size = st.st_size
    h = hashlib.sha256(f"{size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read())
    target = cache_dir("converted") / f"{path.stem}-{h.hexdigest()[:16]}"
    if (target / "config.json").exists() and not damage(target):
        return target
    from qinfer.sources.gguf_convert import convert_gguf

    with atomic_dir(target, force=True) as tmp:
        convert_gguf(path, tmp)
        write_manifest(tmp)
    return target
