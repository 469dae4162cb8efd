"""Builders for tiny fake Debian packages and R lazy-load databases, so calib tests never touch the network.

The R objects are serialized by the ``rdata`` package's own writer (an implementation independent of the
reader under test); the lazy-load framing and the ``ar``/tar layers follow R's ``makeLazyLoadDB`` and
``dpkg-deb`` byte for byte.
"""

import bz2
import gzip
import io
import lzma
import struct
import tarfile
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from rdata.conversion import convert_python_to_r_data
from rdata.unparser import unparse_data

RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def serialize(obj) -> bytes:
    """XDR serialization (``X\\n`` ...) of a Python object, as R's ``serialize()`` would write it."""
    return unparse_data(convert_python_to_r_data(obj), file_format="xdr", file_type="rds")


def frame(raw: bytes, compressed: int, kind: bytes = b"") -> bytes:
    """One .rdb blob, as R_compress1/2/3 write it (``kind`` is the type byte for compressed 2 and 3)."""
    if not compressed:
        return raw
    header = struct.pack(">I", len(raw))
    if compressed == 1:
        return header + zlib.compress(raw)
    payload = {
        b"0": lambda data: data,
        b"1": zlib.compress,
        b"2": bz2.compress,
        b"Z": lambda data: lzma.compress(
            data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}]
        ),
    }[kind](raw)
    return header + kind + payload


def build_lazyload(objects: dict, compressed: int = 1, kind: bytes = b"") -> tuple[bytes, bytes]:
    """Return ``(rdx, rdb)`` for ``objects`` (name -> Python value), like ``makeLazyLoadDB``."""
    rdb = b""
    variables = {}
    for name, value in objects.items():
        blob = frame(serialize(value), compressed, kind)
        variables[name] = np.array([len(rdb), len(blob)], dtype=np.int32)
        rdb += blob
    flag = np.array([True]) if compressed == 1 else np.array([compressed], dtype=np.int32)
    index = {"variables": variables, "references": {}, "compressed": flag}
    return gzip.compress(serialize(index)), rdb


def build_tar(files: dict[str, bytes], compression: str = "xz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(f"./{path}")  # dpkg-deb's spelling
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build_ar(members: dict[str, bytes], gnu_names: bool = False) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        label = f"{name}/" if gnu_names else name
        header = f"{label:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode("ascii")
        assert len(header) == 60
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return out


def build_deb(files: dict[str, bytes], data_compression: str = "xz", gnu_names: bool = False) -> bytes:
    """A binary package holding ``files`` (paths without a leading slash) in its data tarball."""
    suffix = {"xz": ".xz", "gz": ".gz", "": ""}[data_compression]
    return build_ar(
        {
            "debian-binary": b"2.0\n",
            "control.tar.xz": build_tar({"control": b"Package: fake\n"}),
            f"data.tar{suffix}": build_tar(files, data_compression),
        },
        gnu_names=gnu_names,
    )


def fake_book(name: str, heading: str, n_chapters: int = 3) -> list[str]:
    """An R character vector shaped like a janeaustenr novel: title page, then chapters of lines."""
    lines = [name.upper(), "", "By Jane Austen", "", ""]
    for i in range(1, n_chapters + 1):
        lines += [heading.format(i=i, roman="I" * i), "", "", f"{name} chapter {i} opens here.",
                  f"{name} chapter {i} goes on.", ""]
    return lines


FAKE_BOOKS = {
    "emma": fake_book("emma", "CHAPTER {roman}") + ["", "FINIS"],
    "mansfieldpark": fake_book("mansfieldpark", "CHAPTER {roman}") + ["A line with \u00a35 and caf\u00e9."],
    "northangerabbey": fake_book("northangerabbey", "CHAPTER {i}"),
    "persuasion": fake_book("persuasion", "Chapter {i}") + ["Finis"],
    "prideprejudice": fake_book("prideprejudice", "Chapter {i}") + [None],  # R NA_character_
    "sensesensibility": fake_book("sensesensibility", "CHAPTER {i}"),
}


def fake_austen_deb(books: dict = FAKE_BOOKS) -> bytes:
    rdx, rdb = build_lazyload({name: np.array(lines, dtype=object) for name, lines in books.items()})
    return build_deb({f"{RDATA}.rdx": rdx, f"{RDATA}.rdb": rdb})


@pytest.fixture
def calib_builders():
    """The builders above, for test modules (a conftest is not importable as a module)."""
    return SimpleNamespace(
        serialize=serialize,
        build_lazyload=build_lazyload,
        build_tar=build_tar,
        build_ar=build_ar,
        build_deb=build_deb,
        fake_austen_deb=fake_austen_deb,
        fake_books=FAKE_BOOKS,
    )
