import re

import pytest
from click.testing import CliRunner

from qinfer.evals.diagnostics.prefill_bench import main
from qinfer.format import QuantScheme
from qinfer.kernels import cpu_library
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.evals.eval_fixtures import tiny_model

needs_kernels = pytest.mark.skipif(not cpu_library.available(),
                                   reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
WEIGHT = re.compile(r"^\s*(int4 g32|fp8 e4m3)\s+(\d+) x (\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(yes|NO)$", re.M)
PREFILL = re.compile(r"^prefill \(12 tokens\): (\S+) ms dequantizing with PyTorch's ops, (\S+) ms in C \((\S+)x\); "
                     r"last logits (the same|differ)$", re.M)
ROWS = re.compile(r"^\s+(\d+) tokens:\s+(\S+) ms through the int4 kernel,\s+(\S+) ms dequantized \((\S+)x\)$", re.M)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill_bench")
    ref = tiny_model(root / "ref")
    quantize_model(ref, root / "rtn", QuantScheme(method="rtn", bits=4, group_size=32), CalibConfig(samples=2, seq_len=16))
    fp8 = QuantScheme(method="fp8", bits=8, group_size=-1, format="fp8")
    quantize_model(ref, root / "fp8", fp8, CalibConfig(samples=2, seq_len=16))
    return {"ref": ref, "rtn": root / "rtn", "fp8": root / "fp8"}


@needs_kernels
@pytest.mark.parametrize("name", ["rtn", "fp8"])
def test_prefill_bench_times_each_dequantize_and_the_prefill(folders, name):
    args = [str(folders[name]), "--prompt-tokens", "12", "--rows", "3,40", "--rounds", "2", "--calls", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    weights = WEIGHT.findall(result.stdout)
    assert weights and all(w[7] == "yes" and float(w[4]) > 0 and float(w[5]) > 0 for w in weights)
    prefill = PREFILL.search(result.stdout)
    assert prefill and prefill.group(4) == "the same" and float(prefill.group(1)) > 0
    rows = ROWS.findall(result.stdout)
    assert [int(r[0]) for r in rows] == ([3, 40] if name == "rtn" else [])  # 4-bit weights only
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_prefill_bench_names_a_model_without_packed_weights_in_one_line(folders):
    result = CliRunner().invoke(main, [str(folders["ref"])])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: ")


def test_prefill_bench_refuses_bad_rows(folders):
    result = CliRunner().invoke(main, [str(folders["rtn"]), "--rows", "16,x"])
    assert result.exit_code == 1 and "--rows takes prompt lengths" in result.output


@needs_kernels
@pytest.mark.parametrize("extra, message", [
    (["--prompt-tokens", "300"], "--prompt-tokens asks for a 300-token prompt, longer than the model's context of 256"),
    (["--prompt-tokens", "12", "--rows", "3,300"], "--rows asks for a 300-token prompt, longer than the model's"),
])
def test_prefill_bench_refuses_a_long_prompt_before_any_timing(folders, extra, message):
    result = CliRunner().invoke(main, [str(folders["rtn"]), "--rounds", "1", "--calls", "1", *extra])
    assert result.exit_code == 1 and "medians over" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output
