"""BIG-bench's JSON tasks, read out of the ``bigbench==1.0.0`` sdist.

PyPI no longer serves that sdist's files (only 0.0.1, which holds no tasks), so qinfer's default tasks come from
:mod:`qinfer.evals.benchmarks`; a user who has the sdist (``bigbench-1.0.0.tar.gz``) names it with
``qinfer eval --bigbench-sdist FILE`` or copies it into the cache folder below.

Every JSON task is ``bigbench-1.0.0/bigbench/benchmark_tasks/<task>/task.json`` in the sdist; a task.json
without ``examples`` is a container whose subtasks are ``<task>/<subtask>/task.json`` (BIG-bench's own
loader reads them the same way). We read the JSON files we need straight out of the gzip stream: the package
is never installed (its requirements pull in TensorFlow) nor extracted.

Cache layout (``qinfer.store.paths.cache_dir() / "data" / "bigbench"``):

- ``bigbench-1.0.0.tar.gz``: the sdist, if copied here; checked against :data:`SDIST_SHA256` before it is read,
  as a ``--bigbench-sdist`` file is.
- ``tasks/<task>.json``: the ``task.json`` of each task read so far, a container's subtasks inlined as
  ``"subtasks": {<subtask folder>: <its task.json>}``. Loading a cached task never opens the sdist.
- ``index.json``: ``{<task>: [<subtask folders>]}`` for every JSON task in the sdist, so that an unknown
  name is reported without reading 358 MB.

Every file is written atomically (temp file beside it, then rename).
"""

import difflib
import json
import re
import sys
import tarfile
from pathlib import Path

from qinfer.store.atomic import write_atomic
from qinfer.store.fingerprint import sha256_file
from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError

SDIST = "bigbench-1.0.0.tar.gz"
# sha256 of bigbench-1.0.0.tar.gz as PyPI served it
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
# Multiple-choice tasks checked end to end; named in error messages as examples.
SUGGESTED = ("general_knowledge", "social_iqa", "strategyqa", "winowhy")
_TASKS_ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a folder name: no path separators, no leading dot


def data_dir() -> Path:
    return cache_dir("data", "bigbench")


def task_json(task: str, sdist: Path | None = None) -> dict:
    """The cached JSON of ``task`` (subtasks inlined), read out of the sdist (``sdist``, else the cache's copy) on
    first use."""
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
    index, data = _scan_sdist(_sdist(task, sdist), task)
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


def _sdist(task: str, given: Path | None) -> Path:
    """The verified sdist: ``given``, else the cache's copy."""
    path = Path(given).expanduser() if given is not None else data_dir() / SDIST
    if not path.is_file():
        from qinfer.evals.benchmarks import TASKS

        where = f"--bigbench-sdist {given}: no such file" if given is not None else "no BIG-bench sdist is at hand"
        raise QinferError(
            f"unknown task {task!r}: qinfer's tasks are {', '.join(TASKS)}; a BIG-bench task needs the {SDIST} "
            f"sdist, which PyPI no longer serves ({where}; pass --bigbench-sdist FILE or copy it to {path.parent})"
        )
    digest = sha256_file(path)
    if digest != SDIST_SHA256:
        raise QinferError(f"{path} has sha256 {digest[:12]}…, not bigbench 1.0.0's {SDIST_SHA256[:12]}…")
    return path
