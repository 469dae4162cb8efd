import re

import pytest
from click.testing import CliRunner

from qinfer.evals.diagnostics.block_swap import main
from tests.evals.eval_fixtures import block_quantized
from tests.tiny_models import make_model

LINE = re.compile(r"^(as quantized|block (\d) restored): perplexity (\S+), KL (\S+), top-1", re.M)


def test_block_swap_finds_the_one_block_that_differs(tiny, tmp_path, calib_file):
    # a copy of the model with only block 1 quantized: putting block 1 back must remove all divergence,
    # putting any other block back none of it
    out = block_quantized(tiny, tmp_path / "one-block")
    args = [str(tiny), str(out), "--text", str(calib_file), "--max-tokens", "96", "--window", "32", "--stride", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = {(m.group(2) or "none"): float(m.group(4)) for m in LINE.finditer(result.stdout)}  # (the bar: stderr)
    assert set(rows) == {"none", "0", "1", "2"}  # the tiny models have 3 blocks
    assert rows["none"] > 0 and rows["1"] == 0  # the same weights give the same logits
    assert rows["0"] == rows["none"] and rows["2"] == rows["none"]


def test_block_swap_names_a_bad_model_folder_in_one_line(tiny, tmp_path):
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "missing")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and "missing" in result.output
    make_model("qwen3", tmp_path / "other")  # not the model's quantized copy: its blocks do not swap in
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "other")])
    assert result.exit_code == 1 and "is not a quantized copy of" in result.output, result.output


def test_block_swap_refuses_an_unquantized_model_as_the_quantized_one(tiny, calib_file):
    args = [str(tiny), str(tiny), "--text", str(calib_file), "--max-tokens", "96", "--window", "32", "--stride", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert f"{tiny} holds no quantized linear" in result.output, result.output


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "-1"], "--max-tokens (-1) must be at least one --window (32)"),
    (["--window", "300", "--max-tokens", "600"], "--window 300 and the BOS before it is longer than"),
    (["--window", "0", "--stride", "0"], "--window must be at least 2 tokens; got 0"),
    (["--stride", "64"], "--stride must be in 1..--window (32)"),
])
def test_block_swap_checks_its_options_as_qinfer_eval_does(tiny, tmp_path, calib_file, extra, message):
    args = [str(tiny), str(block_quantized(tiny, tmp_path / "q")), "--text", str(calib_file), "--window", "32",
            "--stride", "16", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output
