import json
import math
import re
import shutil

import pytest
from click.testing import CliRunner

from qinfer.evals.accuracy import load_text, text_tokens
from qinfer.evals.divergence import text_metrics
from qinfer.evals.forward import window_logits
from qinfer.evals.diagnostics.text_spread import main
from qinfer.model.loader import load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.evals.eval_fixtures import block_quantized

WHOLE = re.compile(r"^(\S+): (\d+) scored tokens, perplexity (\S+)% against the reference, KL (\S+)$", re.M)
SEGMENTS = re.compile(r"^  (\d+) segments of (\d+) tokens: (.*)$", re.M)
WINDOW = dict(window=32, stride=16)


def _metrics(tiny, other, calib_file, max_tokens, block=None):
    tok = Tokenizer.from_folder(tiny)
    tokens = text_tokens(tok, load_text(str(calib_file))[0], max_tokens)
    fns = [window_logits(load_model(f), "bf16", tok.leading_bos) for f in (tiny, other)]
    return text_metrics(fns[0], {"m": fns[1]}, tokens, progress=False, block=block, **WINDOW)["m"]


def test_text_spread_scores_the_whole_text_and_its_segments_as_eval_would(tiny, tmp_path, calib_file):
    other = block_quantized(tiny, tmp_path / "quantized")
    args = [str(tiny), str(other), "--text", str(calib_file), "--max-tokens", "300", "--segment", "64",
            "--window", "32", "--stride", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (whole,) = WHOLE.findall(result.stdout)
    assert whole[0] == other.name and int(whole[1]) == 299  # labelled as qinfer eval labels it
    m = _metrics(tiny, other, calib_file, 300, block=32)
    assert float(whole[2]) == pytest.approx(100 * (m.ppl_ratio - 1), abs=0.0006)
    assert float(whole[3]) == pytest.approx(m.kl, abs=6e-5) and m.kl > 1e-3
    # the standard errors are qinfer eval's, at each block length (299 tokens: 9 blocks of 32, none of 512)
    line = f"blocks of    32 tokens (9 blocks): ±{100 * m.ppl_ratio * m.nll_delta_se:.2f} points, KL ±{m.kl_se:.4f}"
    assert line in result.stdout and "blocks of   512" not in result.stdout
    ((count, length, changes),) = SEGMENTS.findall(result.stdout)
    assert (int(count), int(length)) == (299 // 63, 64)
    changes = [float(c.rstrip("%")) for c in changes.split(", ")]
    assert len(changes) == 4
    # the first segment is exactly what an eval of the first 64 tokens scores (the same windows, the same contexts)
    first = _metrics(tiny, other, calib_file, 64)
    assert changes[0] == pytest.approx(100 * (first.ppl_ratio - 1), abs=0.06)
    assert math.isfinite(sum(changes))


@pytest.mark.parametrize("extra, message", [(["--segment", "16"], "at least one --window"),
                                             (["--max-tokens", "100"], "fewer than two --segment"),
                                             # qinfer eval's own checks, before any model is loaded
                                             (["--window", "1", "--stride", "1"], "--window must be at least 2 tokens"),
                                             (["--stride", "64"], "--stride must be in 1..--window (32)"),
                                             (["--window", "5000", "--segment", "6000", "--max-tokens", "20000"],
                                              "context of 256 tokens"),
                                             (["MODEL", "SMOLLM"], "tokens (config.json vocab_size)")])
def test_text_spread_bad_input_is_one_line(tiny, tmp_path, calib_file, extra, message):
    models = [str(tiny), str(block_quantized(tiny, tmp_path / "quantized"))]
    if extra[0] == "MODEL":  # a vocabulary of another size (refused before the weights are read)
        other = shutil.copytree(tiny, tmp_path / "other")
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
        models, extra = [str(tiny), str(other)], []
    args = [*models, "--text", str(calib_file), "--segment", "64", "--window", "32", "--stride", "16", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output


def test_text_spread_refuses_an_unquantized_model(tiny, tmp_path, calib_file):
    args = [str(tiny), str(block_quantized(tiny, tmp_path / "quantized")), str(tiny), "--text", str(calib_file),
            "--segment", "64", "--window", "32", "--stride", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert f"{tiny} holds no quantized linear" in result.output, result.output
