import re

from click.testing import CliRunner

from qinfer.evals.block_errors import main
from qinfer.format import QuantScheme
from qinfer.quantize import CalibConfig, quantize_model
from tests.test_quantize import calib_file, tiny  # noqa: F401 (fixtures)
from tests.tiny_models import make_model


def test_block_errors_reports_every_block_and_the_worst_tokens(tiny, tmp_path, calib_file):  # noqa: F811
    quantize_model(tiny, tmp_path / "q", QuantScheme(method="rtn", bits=3, group_size=32), CalibConfig())
    args = [str(tiny), str(tmp_path / "q"), "--calib", str(calib_file), "--samples", "8", "--seq-len", "32",
            "--pick", "4", "--top", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    errors = [float(m) for m in re.findall(r"^block \d+: mean squared error (\S+)", result.output, re.M)]
    assert len(errors) == 3 and all(e > 0 for e in errors)  # the tiny models have 3 blocks; 3-bit RTN errs
    assert len(re.findall(r"^  sample #[0-7] token \d+: error", result.output, re.M)) == 3
    share = int(re.search(r"the largest 0.1% of tokens \(after token 0\) hold (\d+)%", result.output).group(1))
    assert 0 < share <= 100


def test_block_errors_names_a_bad_model_folder_in_one_line(tiny, tmp_path):  # noqa: F811
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "missing")])
    assert result.exit_code == 1 and result.exception is not None
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert "missing" in result.output and result.output.startswith("Error: ")


def test_block_errors_refuses_bad_picks_and_another_model(tiny, tmp_path):  # noqa: F811
    quantize_model(tiny, tmp_path / "q", QuantScheme(method="rtn", bits=4, group_size=32), CalibConfig())
    make_model("qwen3", tmp_path / "other")
    for extra, needle in ((["--pick", "0"], "--pick must be at least 1"), (["--blocks", "9"], "--blocks in 1..3"),
                          (["--blocks", "0"], "--blocks in 1..3")):
        result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "q"), *extra])
        assert result.exit_code == 1 and needle in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "other")])
    assert result.exit_code == 1 and "is not a quantized copy of" in result.output, result.output
