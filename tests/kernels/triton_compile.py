"""Compiling Triton kernels for NVIDIA GPUs without one: Triton's own LLVM and ptxas, in a subprocess without
``TRITON_INTERPRET`` (which the test session sets), checks what the interpreter does not (types, tl.dot's
shapes and precisions, shared memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton


def compile_in_subprocess(script: str, targets: list, cache: Path, timeout: int) -> list[str]:
    """Run ``script`` (which compiles for each of ``targets``, given as JSON in argv[1]) and return its stdout
    lines; skip where this triton wheel carries no ptxas."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel carries no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(targets)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()
