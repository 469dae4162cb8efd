import hashlib
import subprocess

import pytest
import torch

from qinfer.calib import austen, debian
from qinfer.calib.sampling import sample_windows
from qinfer.calib.sources import load_calibration_documents
from qinfer.errors import QinferError

DEB_NAME = "r-cran-janeaustenr_1.0.0-1_all.deb"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def no_apt(monkeypatch):
    """Fail the test if anything tries to run apt-get."""

    def refuse(cmd, **kwargs):
        raise AssertionError(f"unexpected subprocess call {cmd}")

    monkeypatch.setattr(debian.subprocess, "run", refuse)


@pytest.fixture
def cached_deb(cache, calib_builders):
    path = cache / "data" / DEB_NAME
    path.parent.mkdir(parents=True)
    path.write_bytes(calib_builders.fake_austen_deb())
    return path


def expected_text(lines):
    return "\n".join("" if line is None else line for line in lines)


def test_fetch_reads_a_deb_in_the_cache(cache, cached_deb, no_apt, calib_builders):
    folder = austen.fetch_austen()
    assert folder == cache / "data" / "austen"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{b}.txt" for b in austen.BOOKS] + ["SHA256SUMS"])
    for name, lines in calib_builders.fake_books.items():
        assert (folder / f"{name}.txt").read_text(encoding="utf-8") == expected_text(lines)
    sums = (folder / "SHA256SUMS").read_text().splitlines()
    assert sums == [
        f"{hashlib.sha256((folder / f'{b}.txt').read_bytes()).hexdigest()}  {b}.txt" for b in austen.BOOKS
    ]


def test_load_books_keeps_utf8_and_na_lines(cache, cached_deb, no_apt):
    books = austen.load_books()
    assert list(books) == list(austen.BOOKS)
    assert books["mansfieldpark"].endswith("A line with \u00a35 and caf\u00e9.")
    assert books["prideprejudice"].endswith("goes on.\n\n")  # the trailing NA line became ""


def test_verified_corpus_is_not_refetched(cache, cached_deb, no_apt):
    folder = austen.fetch_austen()
    cached_deb.unlink()  # a second fetch that needed the package would now fail
    assert austen.fetch_austen() == folder


@pytest.mark.parametrize("damage", ["edit", "delete_book", "delete_sums", "garble_sums"])
def test_checksum_mismatch_refetches(cache, cached_deb, no_apt, damage, capsys):
    folder = austen.fetch_austen()
    original = (folder / "emma.txt").read_text(encoding="utf-8")
    if damage == "edit":
        (folder / "emma.txt").write_text(original[:-1] + "!", encoding="utf-8")
    elif damage == "delete_book":
        (folder / "emma.txt").unlink()
    elif damage == "garble_sums":
        (folder / "SHA256SUMS").write_bytes(b"\xff\xfe not utf-8\n")
    else:
        (folder / "SHA256SUMS").unlink()
    capsys.readouterr()
    assert austen.fetch_austen() == folder
    assert (folder / "emma.txt").read_text(encoding="utf-8") == original
    assert "fails its SHA256SUMS check" in capsys.readouterr().err


def test_fetch_downloads_with_apt_get(cache, monkeypatch, calib_builders, capsys):
    calls = []

    def fake_run(cmd, cwd, **kwargs):
        calls.append(cmd[1:])
        (cwd / DEB_NAME).write_bytes(calib_builders.fake_austen_deb())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(debian.subprocess, "run", fake_run)
    books = austen.load_books()
    assert calls == [["download", "r-cran-janeaustenr"]]
    assert books["emma"].startswith("EMMA\n")
    assert "downloading the Austen corpus (Debian package r-cran-janeaustenr)" in capsys.readouterr().err
    assert not list(cache.glob("data/*.deb"))  # the package was fetched into a temp folder


def test_offline_fetch_says_how_to_fix_it(cache, monkeypatch):
    def offline(cmd, cwd, **kwargs):
        return subprocess.CompletedProcess(cmd, 100, stdout="", stderr="E: Failed to fetch http://deb.debian.org/x\n")

    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(debian.subprocess, "run", offline)
    with pytest.raises(QinferError) as err:
        austen.fetch_austen()
    message = str(err.value)
    assert "\n" not in message
    assert "could not download the Debian package r-cran-janeaustenr" in message
    assert "apt-get update && apt-get download r-cran-janeaustenr" in message
    assert str(cache / "data") in message
    assert not (cache / "data" / "austen").exists()


def test_package_without_a_book_is_rejected(cache, no_apt, calib_builders):
    books = {k: v for k, v in calib_builders.fake_books.items() if k != "persuasion"}
    (cache / "data").mkdir(parents=True)
    (cache / "data" / DEB_NAME).write_bytes(calib_builders.fake_austen_deb(books))
    with pytest.raises(QinferError, match="has no persuasion"):
        austen.fetch_austen()
    assert not (cache / "data" / "austen").exists()


def test_documents_are_chapters_without_the_title_page():
    text = "EMMA\n\nBy Jane Austen\n\nVOLUME I\n\nCHAPTER I\n\n\nFirst.\n\nCHAPTER II\n\nSecond.\nVOLUME II\n"
    assert austen.documents(text) == ["CHAPTER I\n\n\nFirst.", "CHAPTER II\n\nSecond.\nVOLUME II"]


def test_documents_heading_styles_and_empty_chapters():
    text = (
        "Chapter 1\nOne.\n"
        "CHAPTER 2.\n\n\n"  # heading with nothing under it: dropped
        "Chapter 3\nChapter the third began, as prose, with the word Chapter.\n"
        "  Chapter 4\nindented headings are prose, not headings\n"
        "CHAPTER XLVIII  \nlast."
    )
    assert austen.documents(text) == [
        "Chapter 1\nOne.",
        "Chapter 3\nChapter the third began, as prose, with the word Chapter.\n"
        "  Chapter 4\nindented headings are prose, not headings",
        "CHAPTER XLVIII  \nlast.",
    ]


def test_documents_without_headings():
    assert austen.documents("\n  A single essay.\n\nTwo paragraphs.\n") == ["A single essay.\n\nTwo paragraphs."]
    assert austen.documents(" \n\n") == []


def test_split_holds_out_persuasion():
    assert austen.HELDOUT_BOOK == "persuasion"
    assert len(austen.CALIB_BOOKS) == 5
    assert set(austen.CALIB_BOOKS) | {austen.HELDOUT_BOOK} == set(austen.BOOKS)


def test_calibration_and_heldout_text(cache, cached_deb, no_apt, calib_builders):
    docs = austen.calibration_documents()
    assert len(docs) == 5 * 3
    assert docs[0] == "CHAPTER I\n\n\nemma chapter 1 opens here.\nemma chapter 1 goes on."
    assert not any("persuasion" in doc for doc in docs)
    assert all(any(f"{book} chapter 3" in doc for doc in docs) for book in austen.CALIB_BOOKS)
    assert austen.heldout_text() == expected_text(calib_builders.fake_books["persuasion"])


def test_calibration_windows_are_seeded_slices_of_the_calibration_split(cache, cached_deb, no_apt):
    def tokenize(text):
        return list(text.encode("utf-8"))

    def windows(seed):
        return sample_windows(load_calibration_documents("austen"), tokenize, n_samples=6, seq_len=32, seed=seed)

    first = windows(1)
    assert first.shape == (6, 32) and first.dtype == torch.long
    assert torch.equal(first, windows(1)) and not torch.equal(first, windows(2))
    # Each window is a slice of the stream: inside one chapter or across two (chapters outlast 32 bytes).
    docs = [doc.encode("utf-8") for doc in austen.calibration_documents()]
    assert all(any(bytes(row.tolist()) in a + b for a in docs for b in docs) for row in first)


# The real corpus: six novels, ~4 MB, with the chapter counts of the printed editions.
REAL_CHAPTERS = {
    "emma": 55,
    "mansfieldpark": 48,
    "northangerabbey": 31,
    "persuasion": 24,
    "prideprejudice": 61,
    "sensesensibility": 50,
}


@pytest.mark.slow
def test_real_corpus_from_debian(cache):
    books = austen.load_books()
    assert {name: len(austen.documents(text)) for name, text in books.items()} == REAL_CHAPTERS
    sizes = {name: len(text.encode("utf-8")) for name, text in books.items()}
    assert 3_800_000 < sum(sizes.values()) < 4_300_000
    assert all(sizes[name] > 400_000 for name in austen.BOOKS)
    assert books["prideprejudice"].startswith("PRIDE AND PREJUDICE")
    assert "Sir Walter Elliot, of Kellynch Hall" in austen.heldout_text()
    docs = austen.calibration_documents()
    assert len(docs) == sum(n for name, n in REAL_CHAPTERS.items() if name != "persuasion")
    assert not any("Kellynch" in doc for doc in docs)
    assert any("Emma Woodhouse, handsome, clever, and rich" in doc for doc in docs)
