import json
import re

import pytest
from click.testing import CliRunner

from qinfer.evals.serve_bench import main
from tests.serving import tiny_chat_model
from tests.tiny_models import TEXT

# concurrency, requests, tok/s, TTFT p50 / p99, TPOT p50 / p99, tokens/request, server TTFT, preemptions, rounds
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+) /\s+(\S+)\s+(\S+) /\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)$",
                 re.M)
HEADLINE = re.compile(r"^HTTP throughput at concurrency 3 = (\S+)x concurrency 1 \((\S+) vs (\S+) tok/s\)$")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_bench")
    (root / "text.txt").write_text(TEXT * 4)
    return tiny_chat_model(root / "model"), root / "text.txt", root


@pytest.fixture(autouse=True)
def _no_kernel_build(monkeypatch):
    """The server would first compile its C kernels into the test's throw-away cache (seconds of the test's time);
    the bench's table is the same without them."""
    monkeypatch.setenv("QINFER_CPU_GEMV", "0")


def bench(inputs, *extra):
    model, text, root = inputs
    args = ["--model", str(model), "--text", str(text), "--out", str(root / "out"), "--prompt-tokens", "16",
            "--max-tokens", "6", "--rounds", "1", *extra]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_serve_bench_reports_each_concurrency_and_the_headline(inputs, endpoint):
    result = bench(inputs, "--concurrency", "1,3", "--requests", "3", "--endpoint", endpoint)
    assert result.exit_code == 0, result.output
    rows = ROW.findall(result.stdout)
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 3), (3, 3)], result.stdout
    for r in rows:
        tok_s, ttft50, ttft99, tpot50, tpot99, tokens, server_ttft = map(float, r[2:9])
        assert tok_s > 0 and 0 < ttft50 <= ttft99 and 0 < tpot50 <= tpot99 and 1 <= tokens <= 6
        assert server_ttft > 0 and int(r[9]) == 0 and float(r[10]) == tok_s  # one round: its figure is the median
    lines = result.stdout.strip().splitlines()
    headline = HEADLINE.match(lines[-1])
    assert headline, lines[-1]
    ratio, high, low = map(float, headline.groups())
    assert (high, low) == (float(rows[1][2]), float(rows[0][2])) and ratio == pytest.approx(high / low, abs=0.06)
    saved = json.loads((inputs[2] / "out" / "serve_bench.json").read_text())
    assert saved["headline"] == lines[-1] and saved["config"]["endpoint"] == endpoint
    assert [level["requests"] for level in saved["levels"]] == [3, 3]


def test_serve_bench_says_in_one_line_why_the_server_did_not_start(inputs):
    result = bench(inputs, "--concurrency", "1", "--kv-memory", "lots")
    assert result.exit_code == 1 and "Traceback" not in result.output
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("Error: qinfer serve exited with status 2 before it was ready")
    assert "'lots' is not a size" in error[0]


def test_serve_bench_refuses_a_bad_concurrency(inputs):
    result = bench(inputs, "--concurrency", "1,x")
    assert result.exit_code == 1 and result.stderr.startswith("Error: --concurrency 1,x: give numbers of clients")
