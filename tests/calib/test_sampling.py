import pytest
import torch

from qinfer.calib import sampling
from qinfer.calib.sampling import sample_windows
from qinfer.errors import QinferError


def char_ids(text):
    return [ord(c) for c in text]


# Distinct letters per document, so a window tells which documents it came from.
DOCS = [letter * 40 for letter in "abcdefghij"]


def as_text(row):
    return "".join(map(chr, row.tolist()))


def test_shape_dtype_and_determinism():
    first = sample_windows(DOCS, char_ids, n_samples=8, seq_len=16, seed=3)
    assert first.shape == (8, 16) and first.dtype == torch.int64
    assert torch.equal(first, sample_windows(DOCS, char_ids, n_samples=8, seq_len=16, seed=3))
    assert not torch.equal(first, sample_windows(DOCS, char_ids, n_samples=8, seq_len=16, seed=4))


def test_windows_are_contiguous_slices_of_the_stream():
    windows = sample_windows(DOCS, char_ids, n_samples=50, seq_len=25, seed=0)
    for row in windows:
        text = as_text(row)
        # A 25-token window spans at most two 40-token documents: one run, or two runs of different letters.
        runs = [text[0]] + [b for a, b in zip(text, text[1:]) if a != b]
        assert len(runs) <= 2 and len(set(runs)) == len(runs)


def test_window_starts_cover_both_ends():
    # One document of 0..99: a window's first id is its start, which must lie in [0, 100 - seq_len].
    doc = "".join(map(chr, range(100)))
    windows = sample_windows([doc], char_ids, n_samples=2000, seq_len=10, seed=0)
    starts = windows[:, 0]
    assert torch.equal(windows, starts[:, None] + torch.arange(10))
    assert starts.min().item() == 0 and starts.max().item() == 90


def test_text_exactly_one_window_long():
    windows = sample_windows(["abcd"], char_ids, n_samples=3, seq_len=4)
    assert windows.tolist() == [char_ids("abcd")] * 3


def test_too_short_raises_a_clear_error():
    expected = r"too short: 7 tokens from 2 documents, fewer than one calibration window \(8 tokens\)"
    with pytest.raises(QinferError, match=expected):
        sample_windows(["abc", "defg"], char_ids, n_samples=1, seq_len=8)
    with pytest.raises(QinferError, match="3 tokens from 1 document, "):
        sample_windows(["abc"], char_ids, n_samples=1, seq_len=8)
    with pytest.raises(QinferError, match="0 tokens from 0 documents"):
        sample_windows([], char_ids, n_samples=1, seq_len=8)


@pytest.mark.parametrize(("n_samples", "seq_len"), [(0, 8), (4, 0), (-1, 8)])
def test_bad_sizes(n_samples, seq_len):
    with pytest.raises(QinferError, match="n_samples >= 1 and seq_len >= 1"):
        sample_windows(DOCS, char_ids, n_samples=n_samples, seq_len=seq_len)


def test_tokenizes_only_until_the_budget(monkeypatch):
    monkeypatch.setattr(sampling, "OVERSAMPLE", 2)
    seen = []

    def tokenize(text):
        seen.append(text)
        return char_ids(text)

    # budget = 2 * 2 * 30 = 120 tokens = 3 documents of 40
    windows = sample_windows(DOCS, tokenize, n_samples=2, seq_len=30, seed=5)
    assert len(seen) == 3
    assert set("".join(map(as_text, windows))) <= {doc[0] for doc in seen}


def test_every_document_is_reachable_when_the_budget_allows():
    windows = sample_windows(DOCS, char_ids, n_samples=400, seq_len=5, seed=0)
    assert {chr(i) for i in windows.flatten().tolist()} == set("abcdefghij")


def test_separator_goes_between_documents_only():
    windows = sample_windows(["ab", "cd"], char_ids, n_samples=200, seq_len=5, separator=[0])
    # Stream is a b 0 c d or c d 0 a b: exactly one separator, in the middle.
    assert {tuple(row) for row in windows.tolist()} <= {(97, 98, 0, 99, 100), (99, 100, 0, 97, 98)}


def test_reports_the_stream_it_drew_from():
    # DOCS: 10 documents of 40 characters; the budget (4 * 2 * 30) stops tokenizing after 6 of them
    windows, stream = sampling.sample_windows_from_stream(DOCS, char_ids, n_samples=2, seq_len=30, seed=5)
    assert stream == 240 and torch.equal(windows, sample_windows(DOCS, char_ids, n_samples=2, seq_len=30, seed=5))
    _, whole = sampling.sample_windows_from_stream(DOCS, char_ids, n_samples=50, seq_len=30)
    assert whole == 400  # the documents ran out before the budget


def test_repeat_note_says_how_often_each_token_is_read():
    assert sampling.repeat_note(n_samples=10, seq_len=40, stream_tokens=400) is None  # exactly the text's length
    note = sampling.repeat_note(n_samples=4000, seq_len=32, stream_tokens=2931)
    assert "holds 2,931 tokens" in note and "take 128,000" in note and "read 44 times" in note
    assert "read 1.5 times" in sampling.repeat_note(n_samples=3, seq_len=200, stream_tokens=400)
