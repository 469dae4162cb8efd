"""Reading a user's text and JSON files with one-line errors that name the file, the problem and the fix."""

import json
from pathlib import Path

from qinfer.errors import QinferError


def read_text(path: Path, fix: str, encoding: str = "utf-8") -> str:
    """``path``'s text, or one line naming why it cannot be read, ending in ``fix``. A missing file raises
    FileNotFoundError, which callers that have their own words for it catch."""
    try:
        return Path(path).read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise QinferError(f"{path} is not UTF-8 text (byte {e.start}): {fix}") from None
    except FileNotFoundError:
        raise
    except OSError as e:  # a directory, a file this user may not read, an I/O error
        raise QinferError(f"{path} cannot be read ({e.strerror or e}): make it a readable file, or {fix}") from None


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in the UTF-8 file ``path``, or one line naming what is wrong with it, ending in ``fix``."""
    try:
        value = json.loads(read_text(path, fix))
    except json.JSONDecodeError as e:
        raise QinferError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): {fix}") from None
    if not isinstance(value, dict):
        raise QinferError(f"{path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value
