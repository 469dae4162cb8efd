"""The attention benchmark runs end to end on small shapes and prints one line per case in the issue's form."""

import re

import pytest
from click.testing import CliRunner

from qinfer.evals.diagnostics import attention_bench
from qinfer.kernels import cpu_library
from tests.evals.eval_fixtures import fake_roofline


@pytest.fixture(autouse=True)
def roofline(monkeypatch):
    monkeypatch.setattr(attention_bench, "measure_roofline", lambda device: fake_roofline())


def test_one_line_per_case_then_capacity_and_the_projection():
    if not cpu_library.available():
        pytest.skip(f"the C kernels are not built here: {cpu_library.unavailable_reason()}")
    args = ["--contexts", "40,1024", "--batches", "1,3", "--dtypes", "bf16,int8", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "64", "--layers", "2", "--repeats", "1"]
    result = CliRunner().invoke(attention_bench.main, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    case = r"(bf16|int8) (40|1k) batch [13]: [\d.]+ GB/s = \d+% of 20\.0 GB/s"
    cases = [line for line in lines if re.match(case, line)]
    assert len(cases) == 8
    # bytes of int8 1k batch 3: keys and values of 2 KV heads, 64 codes + a 4-byte scale each, queries and outputs
    int8 = next(line for line in cases if line.startswith("int8 1k batch 3"))
    assert f"{(2 * 3 * 1024 * 2 * (64 + 4) + 2 * 2 * 3 * 4 * 64) / 1e6:.1f} MB" in int8
    per_gib = (1 << 30) // (2 * 2 * (64 * 2) * 2), (1 << 30) // (2 * 2 * (64 + 4) * 2)
    assert f"bf16 {per_gib[0]:,}, int8 {per_gib[1]:,}" in result.output
    assert "projection, not a measurement" in result.output
    assert sum(1 for line in lines if re.match(r"  (bf16|int8) .* batch \d: [\d.]+ us$", line)) == 8


@pytest.mark.parametrize("args, message", [
    (["--contexts", "512,x"], "--contexts takes a comma-separated list of positive integers"),
    (["--dtypes", "int4"], "--dtypes takes a comma-separated list of bf16, int8, fp8"),
    (["--heads", "3", "--kv-heads", "2"], "--heads must be a multiple of --kv-heads"),
])
def test_bad_settings_are_one_line(args, message):
    result = CliRunner().invoke(attention_bench.main, args)
    assert result.exit_code == 1 and result.output.count("\n") == 1 and message in result.output
