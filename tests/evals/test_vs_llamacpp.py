import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qinfer.evals import vs_llamacpp
from qinfer.evals.vs_llamacpp import format_table, gguf_decode_bytes, headline, main
from qinfer.format import QuantScheme
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from qinfer.sources.resolve import resolve_model
from tests.evals.eval_fixtures import install_roofline
from tests.gguf_fixtures import bpe_vocab_metadata, llamacpp_tensors, tiny_llama, write_gguf

needs_llamacpp = pytest.mark.skipif(vs_llamacpp.llamacpp_missing() is not None,
                                    reason="llama-cpp-python is not installed")
ROW = re.compile(r"^\| (\S+) \| (llama\.cpp \S+|qinfer bf16|qinfer 4-bit(?: \S+)?) \| (\S+) \| (\S+) \| (\S+) \| "
                 r"(\S+) \| (\d+) \| (\d+)% \|$", re.M)
# the command the issue names: a native build (llama-cpp-python's default) crashed on an AMX Xeon
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON '
           '-DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python==0.3.36')
FAST = ["--threads", "1", "--repeats", "1", "--decode-tokens", "4", "--prompt-tokens", "40"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama GGUF (fp32, its MLP linears and embedding Q8_0, not the norms, which llama.cpp keeps in fp32; an
    untied output), as llama.cpp's converter writes one."""
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, "llama", model.config, llamacpp_tensors(model, "llama"), vocab,
                      quantize=("ffn_gate", "ffn_up", "ffn_down", "token_embd"))


@pytest.fixture
def four_bit(tiny_gguf, tmp_path):
    """The GGUF's reference (converted in this test's cache) and an RTN 4-bit quantization of it."""
    install_roofline()
    reference = resolve_model(str(tiny_gguf))
    quantize_model(reference, tmp_path / "rtn", QuantScheme(method="rtn", bits=4, group_size=32),
                   CalibConfig(samples=2, seq_len=16))
    return tmp_path / "rtn"


def _run(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result


def test_gguf_decode_bytes_counts_one_embedding_row_of_an_untied_model(tiny_gguf):
    from qinfer.sources.gguf_convert import open_gguf

    tensors = {t.name: t for t in open_gguf(tiny_gguf).tensors}
    embedding = tensors["token_embd.weight"]
    weights = sum(int(t.n_bytes) for t in tensors.values()) - int(embedding.n_bytes)
    row = int(embedding.n_bytes) // int(embedding.shape[-1])
    kv = 2 * 2 * 2 * 16 * 2  # layers x (key, value) x KV heads x head dim x f16, per position
    assert gguf_decode_bytes(tiny_gguf, 10) == weights + row + 10 * kv


def test_qinfer_side_writes_the_table_the_json_and_the_headline(tiny_gguf, four_bit, tmp_path):
    out = tmp_path / "r.json"
    result = _run([str(tiny_gguf), "--quantized", str(four_bit), "--qinfer-only", "--out", str(out), *FAST])
    rows = ROW.findall(result.stdout)
    assert [r[1] for r in rows] == ["qinfer bf16", "qinfer 4-bit rtn-w4g32"]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 and r[3] == r[5] == "-" for r in rows)
    data = json.loads(out.read_text())
    engines = data["models"][str(tiny_gguf)]["engines"]
    assert [len(e["runs"]) for e in engines.values()] == [1, 1] and data["threads"] == 1
    assert engines["qinfer 4-bit"]["decode_bytes"] < engines["qinfer bf16"]["decode_bytes"]
    assert result.stdout.strip().splitlines()[-1] == data["headline"]
    assert data["headline"].startswith(f"{tiny_gguf} 4-bit decode = ") and "--qinfer-only" in data["headline"]


def test_the_table_and_headline_compare_with_llamacpp():
    run = {"decode_tok_s": 10.0, "prefill_tok_s": 100.0, "decode_bytes": 2e6, "mbu": 0.5}
    data = {"cpu": "a CPU", "threads": 2, "repeats": 5, "decode_tokens": 128, "decode_prompt_tokens": 16,
            "prompt_tokens": 512, "roofline": {"bandwidth_gbs": 20.0},
            "models": {"m": {"gguf_type": "Q4_K_M", "engines": {
                "llama.cpp": run, "qinfer bf16": {**run, "decode_tok_s": 5.0},
                "qinfer 4-bit": {**run, "decode_tok_s": 21.0, "prefill_tok_s": 50.0}}}}}
    rows = ROW.findall(format_table(data))
    assert [r[1:6] for r in rows] == [("llama.cpp Q4_K_M", "10.0", "1.00x", "100", "1.00x"),
                                      ("qinfer bf16", "5.0", "0.50x", "100", "1.00x"),
                                      ("qinfer 4-bit", "21.0", "2.10x", "50", "0.50x")]
    assert headline(data) == "m 4-bit decode = 2.10x llama.cpp Q4_K_M"


def test_without_llamacpp_it_names_the_install_command_in_one_line(tiny_gguf, monkeypatch):
    monkeypatch.setattr(vs_llamacpp, "LLAMACPP_MODULE", "llama_cpp_not_installed_here")
    result = CliRunner().invoke(main, [str(tiny_gguf), *FAST])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert INSTALL in result.output and "--qinfer-only" in result.output


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["a.gguf", "b.gguf", "--quantized", "."], "--quantized names one model's 4-bit folder"),
    (["nothing-here", "--qinfer-only"], "llama.cpp runs a GGUF"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("Error: ") and message in result.output, result.output


def test_a_prompt_past_the_context_is_refused_before_any_run(tiny_gguf, four_bit):
    result = CliRunner().invoke(main, [str(tiny_gguf), "--quantized", str(four_bit), "--qinfer-only",
                                       "--prompt-tokens", "500"])
    assert result.exit_code == 1 and "reads 128 positions" in result.output and "round" not in result.output


@needs_llamacpp
def test_llamacpp_and_qinfer_side_by_side(tiny_gguf, four_bit, tmp_path):
    out = tmp_path / "r.json"
    result = _run([str(tiny_gguf), "--quantized", str(four_bit), "--out", str(out), *FAST])
    rows = ROW.findall(result.stdout)
    assert [r[1] for r in rows] == ["llama.cpp GGUF", "qinfer bf16", "qinfer 4-bit rtn-w4g32"]
    assert rows[0][3] == rows[0][5] == "1.00x" and all(float(r[2]) > 0 for r in rows)
    data = json.loads(out.read_text())
    assert data["llama_cpp_python"] == vs_llamacpp.LLAMACPP_VERSION
    assert re.fullmatch(rf"{re.escape(str(tiny_gguf))} 4-bit decode = \d+\.\d\dx llama\.cpp GGUF",
                        result.stdout.strip().splitlines()[-1])


def test_the_llamacpp_run_does_not_load_torch():
    # the llama.cpp subprocess imports the module: torch's OpenMP runtime must stay out of llama.cpp's process
    code = "import sys, qinfer.evals.vs_llamacpp; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]  # this checkout, not an installed qinfer
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout == "False\n"
