"""BIG-bench's JSON tasks, read out of the ``bigbench==1.0.0`` sdist on PyPI.

Every JSON task is ``bigbench-1.0.0/bigbench/benchmark_tasks/<task>/task.json`` in the sdist; a task.json
without ``examples`` is a container whose subtasks are ``<task>/<subtask>/task.json`` (BIG-bench's own
loader reads them the same way). We fetch the sdist with pip, because PyPI is the one site our machines
can always reach and pip checks PyPI's hash, and read the JSON files we need straight out of the gzip
stream: the package is never installed (its requirements pull in TensorFlow) nor extracted.

Cache layout (``qinfer.cache.cache_dir() / "data" / "bigbench"``):

- ``bigbench-1.0.0.tar.gz``: the sdist, checked against :data:`SDIST_SHA256` before it is read. It is
  kept (358 MB) because reading another task out of it takes seconds where downloading it again takes a
  minute; on a machine without PyPI access, copying the file here is the way in.
- ``tasks/<task>.json``: the ``task.json`` of each task read so far, a container's subtasks inlined as
  ``"subtasks": {<subtask folder>: <its task.json>}``. Loading a cached task never opens the sdist.
- ``index.json``: ``{<task>: [<subtask folders>]}`` for every JSON task in the sdist, so that an unknown
  name is reported without reading 358 MB.

Every file is written atomically (temp file beside it, then rename).
"""

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from qinfer.cache import cache_dir, sha256_file, temp_path, write_atomic
from qinfer.errors import QinferError
from qinfer.registry import pip_env, pip_failure

SDIST = "bigbench-1.0.0.tar.gz"
REQUIREMENT = "bigbench==1.0.0"
# sha256 of bigbench-1.0.0.tar.gz as PyPI serves it (pip checks it on download; we check a kept copy).
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
# Multiple-choice tasks checked end to end; named in error messages as examples.
SUGGESTED = ("general_knowledge", "social_iqa", "strategyqa", "winowhy")
_TASKS_ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a folder name: no path separators, no leading dot
_PIP_TIMEOUT_S = 1800  # 358 MB; a hung network should still end in a clear error


def data_dir() -> Path:
    return cache_dir("data", "bigbench")


def task_json(task: str) -> dict:
    """The cached JSON of ``task`` (subtasks inlined), read out of the sdist on first use."""
    if not _NAME.fullmatch(task):
        raise QinferError(f"{task!r} is not a BIG-bench task name; use e.g. {', '.join(SUGGESTED)}")
    cached = data_dir() / "tasks" / f"{task}.json"
    if cached.exists():
        try:
            return json.loads(cached.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            print(f"qinfer: {cached} is corrupt; reading {task} from the BIG-bench sdist again", file=sys.stderr)
    index = _read_index()
    if index is not None and task not in index:
        raise _unknown(task, index)
    index, data = _scan_sdist(_sdist(), task)
    write_atomic(data_dir() / "index.json", json.dumps(index, indent=1, sort_keys=True).encode())
    if data is None:
        raise _unknown(task, index)
    write_atomic(cached, json.dumps(data, ensure_ascii=False).encode("utf-8"))
    return data


def _unknown(task: str, index: dict) -> QinferError:
    close = difflib.get_close_matches(task, index, n=5, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"e.g. {', '.join(SUGGESTED)}"
    return QinferError(
        f"unknown BIG-bench task {task!r} (bigbench 1.0.0 has {len(index)} JSON tasks; programmatic ones are "
        f"not supported); {hint}"
    )


def _read_index() -> dict | None:
    path = data_dir() / "index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return index if isinstance(index, dict) else None


def _scan_sdist(sdist: Path, task: str) -> tuple[dict, dict | None]:
    """One pass over the gzip stream: the index of all JSON tasks, and ``task``'s JSON (None if absent)."""
    tops: set[str] = set()
    subfolders: dict[str, list[str]] = {}
    top: dict | None = None
    subtasks: dict[str, dict] = {}
    try:
        # stream mode: one sequential read of the 358 MB gzip, no member table kept
        with tarfile.open(sdist, mode="r|gz") as tar:
            for info in tar:
                rel = info.name.removeprefix(_TASKS_ROOT)
                parts = rel.split("/")
                if rel == info.name or parts[-1] != "task.json" or len(parts) not in (2, 3) or not info.isfile():
                    continue
                if len(parts) == 2:
                    tops.add(parts[0])
                else:
                    subfolders.setdefault(parts[0], []).append(parts[1])
                if parts[0] == task:
                    data = json.load(tar.extractfile(info))
                    if len(parts) == 2:
                        top = data
                    else:
                        subtasks[parts[1]] = data
    except (tarfile.TarError, EOFError, OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QinferError(f"{sdist}: cannot read it ({exc}); delete it and retry") from None
    # Only a folder with its own task.json is a JSON task; BIG-bench ignores subfolders of one with examples.
    index = {name: sorted(subfolders.get(name, [])) for name in sorted(tops)}
    if top is None:
        return index, None
    if "examples" not in top:
        top["subtasks"] = dict(sorted(subtasks.items()))
    return index, top


def _sdist() -> Path:
    """The verified sdist in the cache, downloaded with pip if absent."""
    path = data_dir() / SDIST
    if path.exists():
        digest = sha256_file(path)
        if digest != SDIST_SHA256:
            raise QinferError(
                f"{path} has sha256 {digest[:12]}…, not bigbench 1.0.0's {SDIST_SHA256[:12]}…; delete it and retry"
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"qinfer: downloading BIG-bench ({REQUIREMENT} sdist, 358 MB) from PyPI with pip", file=sys.stderr)
    tmp = temp_path(path.parent, ".bigbench-download-", folder=True)
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", REQUIREMENT, "-d", str(tmp)]
        fix = f"check network access to PyPI, or copy {SDIST} (from `pip download {REQUIREMENT}`) to {path.parent}"
        try:
            progress = sys.stderr.fileno()  # pip's progress bar goes to the user's terminal
        except (AttributeError, OSError, ValueError):  # a stderr replaced by something without a file
            progress = subprocess.DEVNULL
        try:
            proc = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True, timeout=_PIP_TIMEOUT_S,
                                  env=pip_env(tmp))
        except subprocess.TimeoutExpired:
            raise QinferError(f"downloading {REQUIREMENT} timed out after {_PIP_TIMEOUT_S} s; {fix}") from None
        if proc.returncode != 0:
            reason, disk_full = pip_failure(proc.stderr)
            if disk_full:
                raise QinferError(f"disk full while downloading {REQUIREMENT} (358 MB) into {path.parent}: free "
                                  "space (or point QINFER_CACHE at a larger disk) and retry")
            raise QinferError(f"downloading {REQUIREMENT} with pip failed ({reason}); {fix}")
        got = tmp / SDIST
        if not got.exists():
            raise QinferError(f"pip download {REQUIREMENT} wrote no {SDIST}; {fix}")
        if sha256_file(got) != SDIST_SHA256:
            raise QinferError(f"the {SDIST} pip downloaded does not match bigbench 1.0.0's sha256; {fix}")
        os.replace(got, path)  # same folder, same file system: atomic
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
