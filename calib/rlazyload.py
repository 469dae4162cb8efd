"""Read objects out of an R lazy-load database (``<name>.rdx`` + ``<name>.rdb``) without R.

R packages ship their data sets this way (``data/Rdata.rdx`` / ``Rdata.rdb``). The layout, from R's
``makeLazyLoadDB`` and ``R_compress1/2/3`` in ``src/main/connections.c``:

- ``.rdx`` is an ordinary ``saveRDS`` file (gzip-compressed XDR serialization) of
  ``list(variables = list(<name> = c(offset, length), ...), references = list(...), compressed = <c>)``.
- ``.rdb`` is the concatenation of one blob per variable; a variable's blob is
  ``rdb[offset : offset + length]``:

  * ``compressed`` FALSE (0): the serialization itself;
  * ``compressed`` TRUE (1): a 4-byte big-endian uncompressed length, then a zlib stream;
  * ``compressed`` 2 or 3: the 4-byte length, one type byte, then ``'0'`` stored, ``'1'`` zlib,
    ``'2'`` bzip2, or ``'Z'`` raw LZMA2 with no xz container (R's filter is ``lzma_lzma_preset(6)``).
    R stores a blob as ``'0'`` when compressing would grow it, so stored and compressed blobs mix.

  The decompressed bytes are an XDR serialization (``X\\n`` ...) of the object, parsed here by the
  ``rdata`` package.
- ``references`` holds environments that closures point into; data objects (vectors, lists) have none,
  so this reader ignores them.
"""

import bz2
import lzma
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import rdata

from qinfer.errors import QinferError

# R's init_filters() uses preset 6; a raw LZMA2 decoder must be given the same dictionary size.
_R_LZMA2_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]


@dataclass(frozen=True)
class LazyLoadDB:
    """An opened database: the index is parsed, each object is decompressed and parsed on :meth:`read`.

    Reading one variable at a time lets callers show progress and skip variables they do not need.
    """

    keys: Mapping[str, tuple[int, int]]  # variable name -> (offset, length) in rdb
    compressed: int  # 0, 1, 2 or 3, as R's makeLazyLoadDB(compress=) was given
    rdb: bytes = field(repr=False)
    origin: str  # names the database in error messages

    def read(self, name: str) -> Any:
        """Return variable ``name`` converted by ``rdata`` (character vectors: numpy arrays, NA as None)."""
        if name not in self.keys:
            raise QinferError(f"{self.origin} has no variable {name} (it holds {', '.join(sorted(self.keys))})")
        offset, length = self.keys[name]
        blob = self.rdb[offset : offset + length]
        what = f"{self.origin}, variable {name}"
        if len(blob) != length:
            raise QinferError(f"{what}: the .rdb is truncated (needs bytes {offset}..{offset + length})")
        return _unserialize(_decompress(blob, self.compressed, what), what)


def open_lazyload_db(rdx: bytes, rdb: bytes, origin: str = "R lazy-load database") -> LazyLoadDB:
    """Parse the ``.rdx`` index of a database whose blobs are ``rdb``."""
    index = _unserialize(rdx, f"{origin} index (.rdx)")
    try:
        keys = {}
        for name, key in index["variables"].items():
            offset, length = (int(v) for v in np.asarray(key).ravel())
            keys[str(name)] = (offset, length)
        compressed = int(np.asarray(index["compressed"]).ravel()[0])
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        raise QinferError(f"{origin}: the .rdx is not an R lazy-load index") from None
    return LazyLoadDB(keys=MappingProxyType(keys), compressed=compressed, rdb=rdb, origin=origin)


def character_vector(obj: Any, what: str) -> list[str]:
    """Return an R character vector as a list of ``str``, with ``NA`` as the empty string.

    Raises ``QinferError`` if ``obj`` is not a character vector (``what`` names it in the message).
    """
    if not isinstance(obj, np.ndarray) or obj.dtype.kind not in "UO" or obj.ndim != 1:
        raise QinferError(f"{what} is not an R character vector (got {type(obj).__name__})")
    lines = obj.tolist()
    if not all(line is None or isinstance(line, str) for line in lines):
        raise QinferError(f"{what} is not an R character vector (it holds non-string elements)")
    return ["" if line is None else line for line in lines]


def _decompress(blob: bytes, compressed: int, what: str) -> bytes:
    if not compressed:
        return blob
    if len(blob) < 5:
        raise QinferError(f"{what}: a compressed blob of {len(blob)} bytes is too short to be valid")
    (size,) = struct.unpack(">I", blob[:4])
    try:
        if compressed in (2, 3):
            kind, payload = blob[4:5], blob[5:]
            if kind == b"0":
                raw = payload
            elif kind == b"1":
                raw = zlib.decompress(payload)
            elif kind == b"2":
                raw = bz2.decompress(payload)
            elif kind == b"Z":
                raw = lzma.decompress(payload, format=lzma.FORMAT_RAW, filters=_R_LZMA2_FILTERS)
            else:
                raise QinferError(f"{what}: unknown compression type byte {kind!r}")
        else:
            raw = zlib.decompress(blob[4:])
    except (zlib.error, OSError, EOFError, lzma.LZMAError) as exc:
        raise QinferError(f"{what}: cannot decompress ({exc})") from None
    if len(raw) != size:
        raise QinferError(f"{what}: decompressed to {len(raw)} bytes, the header says {size}")
    return raw


def _unserialize(data: bytes, what: str) -> Any:
    try:
        # extension=".rds": the bytes are a bare serialization, not an .RData file with an RDX header.
        return rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))
    except Exception as exc:  # rdata raises assorted types (ValueError, NotImplementedError, ...) on bad input
        raise QinferError(f"{what}: not a readable R serialization ({type(exc).__name__}: {exc})") from exc
