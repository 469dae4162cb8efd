import json
import logging
import os
import sys
import threading
import types

import pytest

from qinfer.calib import austen, sources
from qinfer.calib.sources import load_calibration_documents
from qinfer.errors import QinferError


def test_austen_is_the_default(monkeypatch):
    monkeypatch.setattr(austen, "calibration_documents", lambda: ["chapter one", "chapter two"])
    assert load_calibration_documents() == ["chapter one", "chapter two"]
    assert load_calibration_documents("austen") == ["chapter one", "chapter two"]


def test_text_file_splits_on_blank_lines(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_bytes("\ufeffFirst doc,\nstill first.\n\n\n  \nSecond doc.\r\n\r\nThird \u00e9.\n\n".encode("utf-8"))
    assert load_calibration_documents(str(path)) == ["First doc,\nstill first.", "Second doc.", "Third \u00e9."]


def test_jsonl_reads_the_text_field(tmp_path):
    path = tmp_path / "calib.jsonl"
    # U+2028 and U+0085 may stand unescaped inside a JSON string: they do not end a line
    rows = [{"text": "  indented code\n", "id": 1}, {"text": "second\u2028line\x85next"}, {"text": "   "}]
    path.write_text("\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\r\n\n", encoding="utf-8")
    assert load_calibration_documents(str(path)) == ["  indented code\n", "second\u2028line\x85next"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "unterminated', r"calib.jsonl:2: malformed JSON \(Unterminated string"),
        ('{"body": "no text"}', r'calib.jsonl:2: expected an object with a "text" field'),
        ('["a", "list"]', r'calib.jsonl:2: expected an object with a "text" field'),
        ('{"text": 42}', r'calib.jsonl:2: the "text" field is int, not a string'),
        ('{"text": "cut mid-emoji \\ud83d"}', r'calib.jsonl:2: the "text" field holds an unpaired surrogate escape '
                                              r'\(\\ud83d, half a character\)'),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "calib.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(QinferError, match=message):
        load_calibration_documents(str(path))


@pytest.mark.parametrize("name", ["missing.txt", "missing.jsonl", "missing.csv", "./data", "/nonexistent/corpus"])
def test_missing_path(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QinferError, match=f"calibration file {name} does not exist"):
        load_calibration_documents(name)


def test_directory_and_unsupported_suffix(tmp_path):
    with pytest.raises(QinferError, match="is a directory"):
        load_calibration_documents(str(tmp_path))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(QinferError, match=r"unsupported type \.csv: use \.txt"):
        load_calibration_documents(str(tmp_path / "data.csv"))


def test_suffixes_in_capitals_and_named_pipes_are_files(tmp_path):
    (tmp_path / "CALIB.TXT").write_text("One.\n\nTwo.\n")
    (tmp_path / "calib.JSONL").write_text('{"text": "One."}\n')
    assert load_calibration_documents(str(tmp_path / "CALIB.TXT")) == ["One.", "Two."]
    assert load_calibration_documents(str(tmp_path / "calib.JSONL")) == ["One."]
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("Piped.\n\nIn.\n",))
    writer.start()
    assert load_calibration_documents(str(fifo)) == ["Piped.", "In."]
    writer.join()


def test_files_without_text(tmp_path):
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(QinferError, match="holds no text"):
        load_calibration_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(QinferError, match="is not UTF-8"):
        load_calibration_documents(str(tmp_path / "latin1.txt"))


def test_dataset_name_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(QinferError, match="allenai/c4 is not a file and the `datasets` library is not installed"):
        load_calibration_documents("allenai/c4")


def fake_datasets(rows=None, error=None):
    def load_dataset(name, split, streaming):
        assert (split, streaming) == ("train", True)
        if error:
            for attempt in range(3):  # as huggingface_hub logs each retry offline
                logging.getLogger("huggingface_hub.utils._http").warning("Retrying in %ss [Retry %s/5].", 1, attempt)
            raise error
        return iter(rows)

    return types.SimpleNamespace(load_dataset=load_dataset)


def test_dataset_text_column(monkeypatch):
    rows = [{"text": ""}, {"text": None}] + [{"text": f"doc {i}"} for i in range(10)]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows))
    monkeypatch.setattr(sources, "MAX_DATASET_DOCUMENTS", 4)
    assert load_calibration_documents("some/corpus") == ["doc 0", "doc 1", "doc 2", "doc 3"]


def test_dataset_errors_are_one_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(error=ConnectionError("no route\nto host")))
    level = logging.getLogger("huggingface_hub").level
    with pytest.raises(QinferError) as err:
        load_calibration_documents("some/corpus")
    assert "\n" not in str(err.value)
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # the retries' warnings: not printed
    assert logging.getLogger("huggingface_hub").level == level  # and the level is put back
    expected = "could not be loaded with `datasets` (offline or unknown dataset?): ConnectionError: no route"
    assert expected in str(err.value)
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"content": "x"}]))
    with pytest.raises(QinferError, match='dataset some/corpus has no "text" column .it has content'):
        load_calibration_documents("some/corpus")
