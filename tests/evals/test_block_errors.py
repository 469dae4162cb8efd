import re

from click.testing import CliRunner

from qinfer.evals.diagnostics.block_errors import main
from qinfer.format import QuantScheme
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.evals.eval_fixtures import block_quantized
from tests.tiny_models import make_model


def test_block_errors_reports_every_block_and_the_worst_tokens(tiny, tmp_path, calib_file):
    quantize_model(tiny, tmp_path / "q", QuantScheme(method="rtn", bits=3, group_size=32), CalibConfig())
    args = [str(tiny), str(tmp_path / "q"), "--calib", str(calib_file), "--samples", "8", "--seq-len", "32",
            "--pick", "4", "--top", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    errors = [float(m) for m in re.findall(r"^block \d+: mean squared error (\S+)", result.output, re.M)]
    assert len(errors) == 3 and all(e > 0 for e in errors)  # the tiny models have 3 blocks; 3-bit RTN errs
    assert len(re.findall(r"^  sample #[0-7] token \d+: error", result.output, re.M)) == 3
    # 4 samples x 31 tokens after token 0: the largest 0.1%, at least one token, is one token
    share = re.search(r"^block 2's squared error after token 0 held by its largest 1 of 124 token errors \(0\.1%, at "
                      r"least one\): (\d+)%$", result.output, re.M)
    assert share and 0 < int(share.group(1)) <= 100, result.output


def test_block_errors_help_says_which_samples_are_scored():
    result = CliRunner().invoke(main, ["--help"])
    text = " ".join(result.output.split())  # as click wraps it
    assert result.exit_code == 0 and "the first PICK - H and the last H, H = min(16, PICK // 2)." in text


def test_block_errors_without_error_gives_no_share_of_it(tiny, tmp_path, calib_file):
    # block 0 is the reference's own: its outputs are the reference's, and 0/0 is no share
    args = [str(tiny), str(block_quantized(tiny, tmp_path / "q")), "--calib", str(calib_file), "--samples", "4",
            "--seq-len", "16", "--pick", "2", "--blocks", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "block 0: mean squared error 0 " in result.output and "nan" not in result.output
    assert "block 0's outputs equal the reference's after token 0: no squared error to share" in result.output


def test_block_errors_names_a_bad_model_folder_in_one_line(tiny, tmp_path):
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "missing")])
    assert result.exit_code == 1 and result.exception is not None
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert "missing" in result.output and result.output.startswith("Error: ")


def test_block_errors_refuses_bad_picks_and_another_model(tiny, tmp_path):
    quantize_model(tiny, tmp_path / "q", QuantScheme(method="rtn", bits=4, group_size=32), CalibConfig())
    make_model("qwen3", tmp_path / "other")
    for extra, needle in ((["--pick", "0"], "--pick must be at least 1"), (["--blocks", "9"], "--blocks in 1..3"),
                          (["--blocks", "0"], "--blocks in 1..3"),
                          (["--top", "-1", "--samples", "4", "--seq-len", "16"], "--top must be at least 0"),
                          (["--seq-len", "300"], "--seq-len 300 is longer than the model's context of 256 tokens")):
        result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "q"), *extra])
        assert result.exit_code == 1 and needle in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "other")])
    assert result.exit_code == 1 and "is not a quantized copy of" in result.output, result.output


def test_block_errors_refuses_an_unquantized_model_as_the_quantized_one(tiny):
    result = CliRunner().invoke(main, [str(tiny), str(tiny)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert f"{tiny} holds no quantized linear" in result.output, result.output
