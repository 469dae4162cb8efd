"""Start the real ``qinfer serve`` in a subprocess on a free loopback port, for the server's tests (through the
serving benchmark's launcher, so that the two start and stop it one way)."""

import json
from pathlib import Path

import torch

from qinfer.evals.serve_bench import serving
from tests.tiny_models import make_model

ROOT = Path(__file__).resolve().parents[1]


def tiny_chat_model(folder: Path, context: int = 256) -> Path:
    """A tiny gemma3-shaped model with a chat template, in ``folder``; ``context``: its positions (a longer one
    lets a reply run long enough to be stopped midway)."""
    make_model("gemma3", folder, dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return folder


def serve(model: str | Path, *args: str, timeout: float = 120, env: dict | None = None):
    """``qinfer serve MODEL --port 0 ARGS...`` until the block ends (then SIGTERM); yields a
    :class:`~qinfer.evals.serve_bench.ServeProcess` (``url``, ``api``, ``process``, ``log()``)."""
    return serving(str(model), list(args), env=env, keep=None, timeout=timeout)
