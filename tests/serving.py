"""Start the real ``qinfer serve`` in a subprocess on a free loopback port, for the server's tests."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.tiny_models import make_model

READY = re.compile(r"qinfer serve: \S+ at (http://\S+) ")
ROOT = Path(__file__).resolve().parents[1]


class Server:
    """A running ``qinfer serve``: its ``url`` (``http://127.0.0.1:PORT``), the process, and what it has written."""

    def __init__(self, process: subprocess.Popen, url: str, lines: list[str]):
        self.process, self.url, self.lines = process, url, lines

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def tiny_chat_model(folder: Path, context: int = 256) -> Path:
    """A tiny gemma3-shaped model with a chat template, in ``folder``; ``context``: its positions (a longer one
    lets a reply run long enough to be stopped midway)."""
    make_model("gemma3", folder, dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return folder


@contextmanager
def serve(model: str | Path, *args: str, timeout: float = 120, env: dict | None = None):
    """``qinfer serve MODEL --port 0 ARGS...`` until the block ends (then SIGTERM); yields a :class:`Server`."""
    command = [sys.executable, "-m", "qinfer", "serve", str(model), "--port", "0", *args]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read():
        for line in process.stdout:
            lines.append(line)
            match = READY.search(line)
            if match and not url:
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"qinfer serve did not start in {timeout} s:\n{''.join(lines)}")
    if not url:
        process.wait(10)
        raise RuntimeError(f"qinfer serve exited ({process.returncode}) before it was ready:\n{''.join(lines)}")
    server = Server(process, url[0], lines)
    try:
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
