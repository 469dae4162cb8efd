import ast
import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TEXT, make_model

# Without a GPU the Triton kernels run in Triton's interpreter, which triton picks for its own library when it
# is first imported (torch may import it before any kernel module), so the choice is made here, first. The
# model sends only CUDA tensors to Triton kernels, so this changes no other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers (5.25) loads a model through Hugging Face's kernels package unless told not to, and refuses to load
# one where that package is absent. The parity references are transformers' own torch code (on a CPU the hub's
# kernels are not used anyway), so they run the same with the package installed or not.
os.environ.setdefault("USE_HUB_KERNELS", "NO")


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path_factory, monkeypatch):
    """Fast tests get a throw-away cache. Slow tests share the real one (``$QINFER_CACHE`` or
    ``~/.cache/qinfer``), so the built-in models and data are pulled once per machine, not per test."""
    if request.node.get_closest_marker("slow"):
        monkeypatch.setenv("QINFER_CACHE", os.environ.get("QINFER_CACHE") or str(Path.home() / ".cache" / "qinfer"))
    else:
        monkeypatch.setenv("QINFER_CACHE", str(tmp_path_factory.getbasetemp() / "qinfer-cache"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    """A plain-text calibration file of the tiny models' text, for ``qinfer quantize --calib``."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join([TEXT] * 40))
    return path


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    """A tiny random model folder of each architecture family (Llama and Gemma 3)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_model(request.param, folder)
    return folder


def qinfer_imports(modules) -> set[str]:
    """The qinfer modules that ``modules`` import, read from their source (``from a package import name`` counts
    as the module ``package.name`` where there is one)."""
    imported = set()
    for name in modules:
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                package = importlib.util.find_spec(node.module).submodule_search_locations is not None
                names = {f"{node.module}.{a.name}" for a in node.names} if package else set()
                imported |= {m for m in names if importlib.util.find_spec(m)} or {node.module}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
    return {m for m in imported if m.startswith("qinfer.")}


def builtin_gguf(gguf_name: str) -> Path:
    """The verified GGUF of a built-in model, fetched into the cache on first use (slow tests only)."""
    from qinfer.sources.registry import BUILTINS, fetch_gguf

    spec = next(s for s in BUILTINS.values() if s.gguf_name == gguf_name)
    return fetch_gguf(spec)
