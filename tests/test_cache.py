"""Atomic output folders: a finished folder or none, and --force never replaces what is not a model; the
source fingerprints cached results are keyed on."""

import sys

import pytest

from qinfer.cache import atomic_dir, check_output, source_fingerprint
from qinfer.errors import QinferError


def test_atomic_dir_replaces_only_when_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target, force=True) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("interrupted")
    assert (target / "config.json").read_text() == "old"  # the old folder is untouched
    with atomic_dir(target, force=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left behind


def test_atomic_dir_replacing_a_file_leaves_nothing_behind(tmp_path):
    target = tmp_path / "out"
    target.write_text("a file")
    with atomic_dir(target, force=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert target.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_check_output(tmp_path):
    check_output(tmp_path / "new" / "out", force=False)  # parents can be made: checked, and not left behind
    assert not (tmp_path / "new").exists()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(QinferError, match="already exists"):
        check_output(model, force=False)
    check_output(model, force=True)  # a model folder may be replaced
    with pytest.raises(QinferError, match="is the model being read"):
        check_output(model, force=True, source=model / ".")
    other = tmp_path / "documents"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(QinferError, match="without a model in it"):
        check_output(other, force=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_output(empty, force=True)
    afile = tmp_path / "file.txt"
    afile.write_text("keep me")
    with pytest.raises(QinferError, match="not a folder"):
        check_output(afile, force=True)
    with pytest.raises(QinferError, match="cannot write"):
        check_output(afile / "out", force=False)  # a file where a folder would have to be
    assert (other / "notes.txt").read_text() == "keep me" and afile.read_text() == "keep me"
    assert not [p for p in tmp_path.rglob(".*probe*")]


def test_source_fingerprint_follows_every_file_it_covers(tmp_path, monkeypatch, request):
    # a module and a package of two on a fresh path: an edit to any of them, or a new module in the package,
    # changes the fingerprint; nothing else does
    (tmp_path / "fp_mod.py").write_text("A = 1\n")
    (tmp_path / "fp_pkg").mkdir()
    (tmp_path / "fp_pkg" / "__init__.py").write_text("")
    (tmp_path / "fp_pkg" / "one.py").write_text("B = 2\n")
    (tmp_path / "other.py").write_text("C = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: [sys.modules.pop(name, None) for name in ("fp_mod", "fp_pkg")])
    seen = [source_fingerprint(("fp_mod",), "fp_pkg")]
    assert source_fingerprint(("fp_mod",), "fp_pkg") == seen[0]  # the same files, the same fingerprint
    (tmp_path / "other.py").write_text("C = 4\n")
    assert source_fingerprint(("fp_mod",), "fp_pkg") == seen[0]
    for path, text in (("fp_mod.py", "A = 2\n"), ("fp_pkg/one.py", "B = 3\n"), ("fp_pkg/two.py", "D = 1\n"),
                       ("fp_pkg/kernel.c", "int e;\n")):  # a C kernel the package builds counts too
        (tmp_path / path).write_text(text)
        seen.append(source_fingerprint(("fp_mod",), "fp_pkg"))
    assert len(set(seen)) == 5
