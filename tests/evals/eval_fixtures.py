"""Offline inputs for eval tests: a tiny model folder, a text file, BIG-bench tasks and a roofline in the cache."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qinfer.evals import bigbench
from qinfer.evals import roofline as rl
from qinfer.format import QuantScheme
from qinfer.quantizers.rtn import rtn_quantize
from tests.tiny_models import TEXT, make_model

# Short questions the tiny tokenizer (trained on one Austen paragraph) can encode, byte-level.
TASK_EXAMPLES = [
    {"input": f"Is {i} a truth universally acknowledged?", "target_scores": {"yes": int(i % 2 == 0), "no": int(i % 2)}}
    for i in range(6)
] + [{"input": "Which is a fortune?", "target_scores": {"a wife": 0, "a good fortune": 1, "a man": 0}}]


def tiny_model(folder: Path, kind: str = "gemma3") -> Path:
    """A tiny random model saved in bf16 (so loading it as bf16 keeps the stored bytes)."""
    make_model(kind, folder, dtype=torch.bfloat16)
    return folder


def block_quantized(reference: Path, out: Path, block: int = 1) -> Path:
    """A copy of ``reference`` with the linears of decoder block ``block`` alone quantized (RTN 2-bit, groups of 32):
    every other tensor is the reference's, so putting that block back gives the reference exactly."""
    shutil.copytree(reference, out)
    scheme = QuantScheme(method="rtn", bits=2, group_size=32)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.startswith(f"model.layers.{block}.") and n.endswith("proj.weight")]:
        prefix = name.removesuffix(".weight")
        tensors.update(rtn_quantize(tensors.pop(name).float(), scheme, name=prefix).tensors(prefix))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    scheme.save(out)
    return out


def text_file(path: Path, repeats: int = 12) -> Path:
    path.write_text(TEXT * repeats, encoding="utf-8")
    return path


def install_tasks(names=("truths",)) -> None:
    """Put BIG-bench style tasks (and an index naming only them) where ``task_json`` looks first."""
    root = bigbench.data_dir()
    (root / "tasks").mkdir(parents=True, exist_ok=True)
    for name in names:
        data = {"name": name, "description": "d", "keywords": ["k"], "metrics": ["multiple_choice_grade"],
                "examples": TASK_EXAMPLES}
        (root / "tasks" / f"{name}.json").write_text(json.dumps(data))
    (root / "index.json").write_text(json.dumps({name: [] for name in names}))


def fake_roofline(**changes) -> rl.Roofline:
    """A roofline that describes this process (so a cache holding it is reused), with round numbers."""
    fields = dict(
        device="cpu", bandwidth_gbs=20.0, peak_tflops={"bf16": 0.5, "fp32": 0.25}, threads=torch.get_num_threads(),
        cpu_name=rl._device_name("cpu"), machine=rl._machine("cpu"), torch_version=torch.__version__,
        timestamp="2026-01-01T00:00:00+00:00", buffer_bytes=1 << 30, matmul_n={"bf16": 2048, "fp32": 1024},
        buffer_pages=rl._buffer_pages("cpu"),
    )
    return rl.Roofline(**{**fields, **changes})


def install_roofline() -> rl.Roofline:
    """A roofline cached for this process, so evals with speed do not spend seconds measuring one."""
    roofline = fake_roofline()
    rl.save_roofline(roofline, rl.roofline_path("cpu"))
    return roofline
