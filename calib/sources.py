"""Where calibration documents come from, named by one string (what a ``--calib`` flag would take).

- ``"austen"`` (the default): the calibration split of the built-in Austen corpus, chapter by chapter.
- a ``.txt`` file: documents separated by blank lines.
- a ``.jsonl`` file: one JSON object per line; its ``"text"`` field is a document.
- anything else: a Hugging Face dataset name, read through the optional ``datasets`` library
  (``train`` split, ``"text"`` column, streamed, at most :data:`MAX_DATASET_DOCUMENTS` documents).

All of them feed :func:`qinfer.calib.sampling.sample_windows`.
"""

import json
import logging
import re
from pathlib import Path

from qinfer.calib import austen
from qinfer.errors import QinferError
from qinfer.store.reading import read_text

DEFAULT_SOURCE = "austen"
# Streaming caps the download from web-scale corpora (C4 is terabytes); 10k documents is tens of MB of
# text, far more than the ~1M tokens a GPTQ run samples.
MAX_DATASET_DOCUMENTS = 10_000

# A missing path with one of these is a file that is not there, not a dataset name.
_PATH_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet", ".md", ".gz", ".zst")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


def load_calibration_documents(source: str = DEFAULT_SOURCE) -> list[str]:
    """Return the documents named by ``source`` (see the module docstring); never an empty list."""
    if source == DEFAULT_SOURCE:
        return austen.calibration_documents()
    path = Path(source).expanduser()
    if path.is_dir():
        raise QinferError(f"calibration source {source} is a directory; give a .txt or .jsonl file")
    suffix = path.suffix.lower()
    if path.exists():  # a regular file, or a named pipe such as mkfifo corpus.txt
        if suffix == ".jsonl":
            docs = _jsonl_documents(path)
        elif suffix == ".txt":
            docs = _text_documents(path)
        else:
            raise QinferError(
                f"calibration file {source} has an unsupported type {path.suffix or '(no suffix)'}: use .txt "
                f'(documents separated by blank lines) or .jsonl (one {{"text": ...}} object per line)'
            )
        if not docs:
            raise QinferError(f"calibration file {source} holds no text")
        return docs
    if suffix in _PATH_SUFFIXES or source.startswith(("/", "./", "../", "~")):
        raise QinferError(f"calibration file {source} does not exist")
    return _dataset_documents(source)


def _read_text(path: Path) -> str:
    # utf-8-sig: editors on Windows prepend a BOM that would otherwise open the first document.
    return read_text(path, "re-save the calibration file as UTF-8", encoding="utf-8-sig")


def _text_documents(path: Path) -> list[str]:
    text = _read_text(path).replace("\r\n", "\n")
    return [doc.strip() for doc in _BLANK_LINES.split(text) if doc.strip()]


def _jsonl_documents(path: Path) -> list[str]:
    docs = []
    # lines end at \n only: str.splitlines() also breaks at U+2028, U+0085 and the like, which a JSON string
    # may hold unescaped (web text does)
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QinferError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise QinferError(f'{path}:{lineno}: expected an object with a "text" field')
        if not isinstance(record["text"], str):
            raise QinferError(f'{path}:{lineno}: the "text" field is {type(record["text"]).__name__}, not a string')
        try:  # JSON may escape half a character (web text cut mid-emoji); the tokenizer takes only whole ones
            record["text"].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise QinferError(f'{path}:{lineno}: the "text" field holds an unpaired surrogate escape '
                              f'(\\u{ord(exc.object[exc.start]):04x}, half a character): fix or drop that line') from None
        if record["text"].strip():
            docs.append(record["text"])
    return docs


def _dataset_documents(name: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise QinferError(
            f"calibration source {name} is not a file and the `datasets` library is not installed; "
            f"pip install datasets, or give a .txt/.jsonl file, or use {DEFAULT_SOURCE!r}"
        ) from None
    # Offline, huggingface_hub logs a warning per retry before it gives up: the one line below says it all.
    quiet = [logging.getLogger(n) for n in ("huggingface_hub", "datasets", "fsspec")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        rows = datasets.load_dataset(name, split="train", streaming=True)
        docs = []
        for row in rows:
            if "text" not in row:
                raise QinferError(f'dataset {name} has no "text" column (it has {", ".join(row)})')
            if isinstance(row["text"], str) and row["text"].strip():
                docs.append(row["text"])
            if len(docs) >= MAX_DATASET_DOCUMENTS:
                break
    except QinferError:
        raise
    except Exception as exc:  # datasets raises many types for "not found" and "offline"
        raise QinferError(
            f"calibration source {name} is not a file and could not be loaded with `datasets` "
            f"(offline or unknown dataset?): {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    if not docs:
        raise QinferError(f"dataset {name} has no non-empty text in its train split")
    return docs
