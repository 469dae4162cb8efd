import numpy as np
import pytest

from qinfer.calib.rlazyload import character_vector, open_lazyload_db
from qinfer.errors import QinferError

LINES = ["CHAPTER 1", "", "A line with \u00a35 and caf\u00e9.", None]


@pytest.mark.parametrize(
    ("compressed", "kind"),
    [(0, b""), (1, b""), (2, b"0"), (2, b"1"), (2, b"2"), (3, b"Z"), (3, b"2"), (3, b"0")],
)
def test_every_compression_round_trips(calib_builders, compressed, kind):
    objects = {"first": np.array(LINES, dtype=object), "second": np.array(["x" * 500, "y"], dtype=object)}
    rdx, rdb = calib_builders.build_lazyload(objects, compressed=compressed, kind=kind)
    db = open_lazyload_db(rdx, rdb)
    assert db.compressed == compressed
    assert list(db.keys) == ["first", "second"]
    assert character_vector(db.read("first"), "first") == ["CHAPTER 1", "", "A line with \u00a35 and caf\u00e9.", ""]
    assert character_vector(db.read("second"), "second") == ["x" * 500, "y"]


def test_offsets_index_the_rdb(calib_builders):
    rdx, rdb = calib_builders.build_lazyload({"a": np.array(["a"]), "b": np.array(["bb", "b"])})
    db = open_lazyload_db(rdx, rdb)
    (a_off, a_len), (b_off, b_len) = db.keys["a"], db.keys["b"]
    assert a_off == 0 and b_off == a_len and b_off + b_len == len(rdb)


def test_unknown_variable_names_what_exists(calib_builders):
    db = open_lazyload_db(*calib_builders.build_lazyload({"emma": np.array(["x"])}), origin="test.rdx")
    with pytest.raises(QinferError, match="test.rdx has no variable persuasion .it holds emma"):
        db.read("persuasion")


def test_truncated_rdb_is_reported(calib_builders):
    rdx, rdb = calib_builders.build_lazyload({"emma": np.array(["some text"] * 10)})
    db = open_lazyload_db(rdx, rdb[:-3])
    with pytest.raises(QinferError, match="truncated"):
        db.read("emma")


def test_bad_type_byte_is_reported(calib_builders):
    rdx, rdb = calib_builders.build_lazyload({"emma": np.array(["x"])}, compressed=3, kind=b"0")
    db = open_lazyload_db(rdx, rdb[:4] + b"Q" + rdb[5:])
    with pytest.raises(QinferError, match="unknown compression type byte b'Q'"):
        db.read("emma")


def test_length_header_is_checked(calib_builders):
    rdx, rdb = calib_builders.build_lazyload({"emma": np.array(["x"])})
    db = open_lazyload_db(rdx, (int.from_bytes(rdb[:4], "big") + 1).to_bytes(4, "big") + rdb[4:])
    with pytest.raises(QinferError, match="the header says"):
        db.read("emma")


def test_corrupt_zlib_is_reported(calib_builders):
    rdx, rdb = calib_builders.build_lazyload({"emma": np.array(["x"])})
    db = open_lazyload_db(rdx, rdb[:6] + bytes(len(rdb) - 6))
    with pytest.raises(QinferError, match="cannot decompress"):
        db.read("emma")


def test_rdx_that_is_not_an_index(calib_builders):
    with pytest.raises(QinferError, match="not an R lazy-load index"):
        open_lazyload_db(calib_builders.serialize(np.array(["just", "strings"])), b"")
    with pytest.raises(QinferError, match="not a readable R serialization"):
        open_lazyload_db(b"this is not R data at all", b"")


def test_character_vector_rejects_other_objects():
    with pytest.raises(QinferError, match="emma is not an R character vector"):
        character_vector(np.array([1, 2], dtype=np.int32), "emma")
    with pytest.raises(QinferError, match="emma is not an R character vector"):
        character_vector({"a": np.array(["x"])}, "emma")
