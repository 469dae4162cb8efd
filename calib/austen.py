"""The built-in calibration corpus: six Jane Austen novels, fetched from Debian.

Why Austen: public-domain English prose, about 4 MB, with no licence questions, and mirrored by Debian
as the R data package ``r-cran-janeaustenr``, so every machine that can reach a Debian mirror can fetch it
(no R needed: the data are read with :mod:`qinfer.calib.rlazyload`). Each novel is an R character vector,
one element per printed line.

Cache layout (``qinfer.store.paths.cache_dir() / "data" / "austen"``): ``<book>.txt`` (UTF-8, lines joined
with ``"\\n"``) for each name in :data:`BOOKS`, and ``SHA256SUMS`` (``sha256sum`` format) over them. The
folder is written atomically and checked on every load; a mismatch or a missing file re-fetches.

The split is fixed so that perplexity on the held-out novel is never measured on calibration text:
*Persuasion* is held out, the other five calibrate.
"""

import hashlib
import re
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from qinfer.store.atomic import atomic_dir
from qinfer.store.paths import cache_dir
from qinfer.calib.debian import download_deb, read_deb_files
from qinfer.calib.rlazyload import character_vector, open_lazyload_db
from qinfer.errors import QinferError

PACKAGE = "r-cran-janeaustenr"
BOOKS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
HELDOUT_BOOK = "persuasion"
CALIB_BOOKS = tuple(book for book in BOOKS if book != HELDOUT_BOOK)
CHECKSUMS = "SHA256SUMS"

_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"

# Headings are "CHAPTER I" (Emma, Mansfield Park), "CHAPTER 1" (Northanger Abbey, Sense and Sensibility)
# or "Chapter 1" (Persuasion, Pride and Prejudice), alone on their line. Requiring the whole line keeps
# prose such as "Chapter the first..." from starting a document.
_CHAPTER = re.compile(r"^(?:CHAPTER|Chapter)[ \t]+(?:[IVXLC]+|\d+)\.?[ \t]*$", re.MULTILINE)


def corpus_dir() -> Path:
    return cache_dir() / "data" / "austen"


def fetch_austen() -> Path:
    """Return the folder holding the six novels as text, fetching them on first use.

    A ``r-cran-janeaustenr_*.deb`` already in ``cache_dir() / "data"`` is used as is (the way in for
    machines without apt or network); otherwise ``apt-get download`` fetches it into a temp folder.
    """
    target = corpus_dir()
    if _verified(target):
        return target
    if target.exists():
        print(f"qinfer: {target} fails its {CHECKSUMS} check; fetching the Austen corpus again", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="qinfer-austen-") as tmp:
        deb = _cached_deb()
        if deb is None:
            print(f"qinfer: downloading the Austen corpus (Debian package {PACKAGE}) with apt-get", file=sys.stderr)
            fix = (
                f"run `apt-get update && apt-get download {PACKAGE}` when online, "
                f"or put the .deb in {cache_dir() / 'data'}"
            )
            deb = download_deb(PACKAGE, Path(tmp), fix)
        books = _read_books(deb)
        with atomic_dir(target, force=True) as out:
            sums = []
            for name in BOOKS:
                data = books[name].encode("utf-8")
                (out / f"{name}.txt").write_bytes(data)
                sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}.txt\n")
            (out / CHECKSUMS).write_text("".join(sums), encoding="utf-8")
    return target


def load_books() -> dict[str, str]:
    """Return ``{book name: full text}`` for the six novels, in :data:`BOOKS` order."""
    folder = fetch_austen()
    return {name: (folder / f"{name}.txt").read_text(encoding="utf-8") for name in BOOKS}


def documents(book_text: str) -> list[str]:
    """Split a novel into chapters, each starting with its heading line.

    Text before the first heading is the title page (and, in Northanger Abbey, a one-paragraph
    advertisement) and is dropped; a chapter with nothing but its heading is dropped. Text without any
    heading is one document. Volume headings and "THE END"/"FINIS" stay at the end of the chapter they
    follow: single lines, not worth a special case.
    """
    starts = [match.start() for match in _CHAPTER.finditer(book_text)]
    if not starts:
        return [book_text.strip()] if book_text.strip() else []
    bounds = starts + [len(book_text)]
    chapters = [book_text[start:end].strip() for start, end in zip(bounds, bounds[1:])]
    return [chapter for chapter in chapters if chapter.partition("\n")[2].strip()]


def calibration_documents() -> list[str]:
    """The chapters of the five calibration novels, book by book in :data:`CALIB_BOOKS` order."""
    books = load_books()
    return [doc for name in CALIB_BOOKS for doc in documents(books[name])]


def heldout_text() -> str:
    """The full text of the held-out novel (*Persuasion*), for perplexity."""
    return load_books()[HELDOUT_BOOK]


def _verified(folder: Path) -> bool:
    sums_file = folder / CHECKSUMS
    if not sums_file.is_file():
        return False
    expected = {}
    try:
        sums = sums_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # unreadable or garbled: fetch again, as for a mismatch
        return False
    for line in sums.splitlines():
        digest, _, name = line.partition("  ")
        expected[name] = digest
    if set(expected) != {f"{name}.txt" for name in BOOKS}:
        return False
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def _cached_deb() -> Path | None:
    # Sorted so the choice is deterministic when several versions sit there; the last is usually newest.
    debs = sorted((cache_dir() / "data").glob(f"{PACKAGE}_*.deb"))
    return debs[-1] if debs else None


def _read_books(deb: Path) -> dict[str, str]:
    files = read_deb_files(deb, [f"{_RDATA}.rdx", f"{_RDATA}.rdb"])
    db = open_lazyload_db(files[f"{_RDATA}.rdx"], files[f"{_RDATA}.rdb"], origin=f"{deb.name}:{_RDATA}")
    missing = [name for name in BOOKS if name not in db.keys]
    if missing:
        raise QinferError(f"{deb} has no {', '.join(missing)} (it holds {', '.join(sorted(db.keys))})")
    books = {}
    for name in tqdm(BOOKS, desc="reading Austen novels", unit="book", file=sys.stderr):
        books[name] = "\n".join(character_vector(db.read(name), f"{deb.name}: {name}"))
    return books
