import math

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.evals.perplexity import perplexity, windows


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (100, 32, 32), (33, 64, 16), (513, 512, 256)])
def test_windows_score_every_token_once(n, window, stride):
    scored = []
    for start, end, first in windows(n, window, stride):
        assert end - start <= window and start <= first - 1
        scored.extend(range(first, end))
    assert len(scored) == len(set(scored))
    if stride < window:
        assert scored == list(range(1, n))


def test_uniform_model_has_vocab_perplexity():
    V = 50
    tokens = torch.randint(0, V, (300,))
    result = perplexity(lambda ids: torch.zeros(1, ids.shape[1], V), tokens, window=64, stride=32, progress=False)
    assert math.isclose(result.ppl, V, rel_tol=1e-6)
    assert result.tokens == 299


def test_perfect_model_has_perplexity_one():
    tokens = torch.randint(0, 20, (100,))

    def oracle(ids):  # knows the next token of the stream at every position
        out = torch.full((1, ids.shape[1], 20), -1e4)
        starts = [i for i in range(100 - ids.shape[1] + 1) if torch.equal(tokens[i : i + ids.shape[1]], ids[0])]
        nxt = tokens[starts[0] + 1 : starts[0] + ids.shape[1] + 1]
        out[0, torch.arange(nxt.numel()), nxt] = 0
        return out

    assert perplexity(oracle, tokens, window=16, stride=8, progress=False).ppl == pytest.approx(1.0)


def test_too_short_text_is_a_clear_error():
    with pytest.raises(QinferError, match="at least 2"):
        windows(1, 512, 256)


def test_text_file_is_read_without_its_byte_order_mark(tmp_path):
    # editors on Windows start a UTF-8 file with a BOM: it is no part of the text (as --calib reads it)
    from qinfer.evals.accuracy import load_text

    path = tmp_path / "text.txt"
    path.write_bytes("\ufeffIt is a truth.".encode("utf-8"))
    assert load_text(str(path)) == ("It is a truth.", str(path))
    path.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(QinferError, match="is not UTF-8 text"):
        load_text(str(path))


def test_text_from_a_pipe_and_a_file_named_heldout(tmp_path, monkeypatch, capsys):
    import os
    import threading

    import qinfer.evals.accuracy as accuracy

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # what a shell's --text <(...) passes: not a regular file, but readable as one
    writer = threading.Thread(target=lambda: fifo.write_text("It is a truth."), daemon=True)
    writer.start()
    try:
        assert accuracy.load_text(str(fifo)) == ("It is a truth.", str(fifo))
    finally:
        if writer.is_alive():  # not read: open the other end so the writer finishes
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)
    # the built-in name wins over a file of that name here, and says so
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heldout").write_text("mine")
    monkeypatch.setattr(accuracy, "heldout_text", lambda: "Persuasion")
    assert accuracy.load_text("heldout")[0] == "Persuasion"
    assert "./heldout" in capsys.readouterr().err


def test_a_bar_in_a_model_name_stays_inside_its_markdown_cell():
    from qinfer.evals.report import _md_table

    table = _md_table(["model", "ppl"], [["tiny|pipe", "3.0"]])
    assert table.splitlines()[-1] == "| tiny\\|pipe | 3.0 |"
