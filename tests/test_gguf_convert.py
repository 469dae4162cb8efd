"""GGUF → HF folder conversion, on tiny GGUFs written the way llama.cpp writes them (see tests/gguf_fixtures.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qinfer.sources import registry
from qinfer.cli.commands import cli
from qinfer.errors import QinferError
from qinfer.sources.gguf_convert import convert_gguf, unpermute_qk
from qinfer.sources.resolve import resolve_model
from tests.conftest import builtin_gguf
from tests.gguf_fixtures import (
    bpe_vocab_metadata,
    llamacpp_permute,
    llamacpp_tensors,
    sp_vocab_metadata,
    tiny_gemma3,
    tiny_llama,
    write_gguf,
)
from tests.test_cli_errors import assert_one_line_error, run_qinfer


def _convert(tmp_path: Path, gguf_path: Path, dtype=torch.float32) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(gguf_path, out, dtype=dtype)
    return out


@pytest.fixture
def llama_case(tmp_path):
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path / "llama.gguf", "llama", model.config, llamacpp_tensors(model, "llama"), vocab)
    return model, path


@pytest.fixture
def gemma3_case(tmp_path):
    # bos == eos == 1, as some Gemma GGUFs claim; the vocabulary says <bos> is 2.
    vocab = sp_vocab_metadata(bos_id=1, eos_id=1)
    model = tiny_gemma3(len(vocab["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", model.config, llamacpp_tensors(model, "gemma3"), vocab)
    return model, path


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)  # 6 heads of dim 8
    restored = unpermute_qk(torch.from_numpy(llamacpp_permute(w, 6)), 6)
    assert torch.equal(restored, torch.from_numpy(w))
    bias = np.arange(6 * 8, dtype=np.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llamacpp_permute(bias, 6)), 6), torch.from_numpy(bias))


def test_llama_names_shapes_and_unpermuted_qk(tmp_path, llama_case):
    model, path = llama_case
    out = _convert(tmp_path, path)
    got = load_file(out / "model.safetensors")
    want = model.state_dict()
    assert got.keys() == want.keys()  # untied: lm_head.weight present, since the GGUF has output.weight
    for name, w in want.items():
        # Every tensor was F32 in the file, so the round trip is exact — Q/K included, which only holds
        # when the permutation is undone with n_head for Q and n_head_kv for K.
        assert torch.equal(got[name], w), name


def test_llama_folder_loads_in_transformers_and_matches(tmp_path, llama_case):
    from transformers import AutoModelForCausalLM

    model, path = llama_case
    out = _convert(tmp_path, path)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = list(range(3, 20))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-5, rtol=0)


def test_llama_config_accepted_by_autoconfig(tmp_path, llama_case):
    from transformers import AutoConfig

    model, path = llama_case
    out = _convert(tmp_path, path, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size"):
        assert getattr(config, field) == getattr(model.config, field), field
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_parameters["rope_theta"] == 50000.0
    assert config.tie_word_embeddings is False
    assert config.dtype == torch.bfloat16
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == 50000.0 and raw["rms_norm_eps"] == 1e-5  # plain readers get plain numbers
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (1, 2)
    assert all(w.dtype == torch.bfloat16 for w in load_file(out / "model.safetensors").values())


def test_q8_0_tensors_are_dequantized(tmp_path):
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    tensors = llamacpp_tensors(model, "llama")
    path = write_gguf(tmp_path / "q8.gguf", "llama", model.config, tensors, vocab, quantize=("ffn_", "token_embd"))
    got = load_file(_convert(tmp_path, path) / "model.safetensors")
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    for gguf_name, hf_name in [("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                               ("token_embd.weight", "model.embed_tokens.weight")]:
        reference = gguf.quants.dequantize(gguf.quants.quantize(tensors[gguf_name], Q8_0), Q8_0)
        assert got[hf_name].shape == model.state_dict()[hf_name].shape
        assert torch.equal(got[hf_name], torch.from_numpy(reference))
        # and Q8_0 is close to the original weights: within half a quantization step per 32-block
        torch.testing.assert_close(got[hf_name], model.state_dict()[hf_name], atol=0.01, rtol=0)


def test_gemma3_norms_minus_one_and_no_permutation(tmp_path, gemma3_case):
    model, path = gemma3_case
    got = load_file(_convert(tmp_path, path) / "model.safetensors")
    want = model.state_dict()
    assert got.keys() == want.keys() - {"lm_head.weight"}  # tied: no output.weight in the GGUF
    for name, w in want.items():
        if name == "lm_head.weight":
            continue
        if "norm" in name:
            # (w + 1) - 1 in fp32 loses at most half an ulp of 1
            torch.testing.assert_close(got[name], w, atol=2**-23, rtol=0)
        else:
            assert torch.equal(got[name], w), name


def test_gemma3_folder_loads_in_transformers_and_matches(tmp_path, gemma3_case):
    from transformers import AutoModelForCausalLM

    model, path = gemma3_case
    out = _convert(tmp_path, path)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # 12 tokens > sliding_window 4: sliding layers, the full layer (5) and both RoPE bases all matter
    ids = list(range(10, 22))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-5, rtol=0)


def test_gemma3_config_and_special_tokens(tmp_path, gemma3_case):
    from transformers import AutoConfig

    _, path = gemma3_case
    out = _convert(tmp_path, path)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForCausalLM"]
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.sliding_window == 4 and config.query_pre_attn_scalar == 32
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.tie_word_embeddings is True
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == 1_000_000.0 and raw["rope_local_base_freq"] == 10_000.0
    assert raw["rope_scaling"] is None
    # ids resolved from the token text, not the file's bos == eos == 1
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (2, 1, 0)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 2
    assert generation["eos_token_id"] == [1, 5]  # <eos>, <end_of_turn>
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<bos>", "<eos>")
    assert (out / "tokenizer.model").is_file() and not (out / "tokenizer.json").exists()


def test_chat_template_goes_into_tokenizer_config(tmp_path, llama_case):
    _, path = llama_case
    out = _convert(tmp_path, path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == bpe_vocab_metadata()["tokenizer.chat_template"]
    assert (out / "tokenizer.json").is_file()


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    with pytest.raises(QinferError, match="is not a GGUF file"):
        _convert(tmp_path, path)


def test_missing_file(tmp_path):
    with pytest.raises(QinferError, match="no such file"):
        _convert(tmp_path, tmp_path / "absent.gguf")


def test_truncated_gguf_at_any_point(tmp_path, llama_case):
    _, path = llama_case
    data = path.read_bytes()
    # cut in the header, in the metadata (vocabulary arrays), in the tensor infos and in the tensor data
    for i, cut in enumerate([5, 30, 200, 3000, len(data) // 2, len(data) - 100]):
        short = tmp_path / f"short{i}.gguf"
        short.write_bytes(data[:cut])
        out = tmp_path / f"out{i}"
        out.mkdir()
        with pytest.raises(QinferError, match="truncated or corrupt"):
            convert_gguf(short, out)


def test_unsupported_architecture(tmp_path):
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path / "q.gguf", "qwen2", model.config, llamacpp_tensors(model, "llama"), vocab)
    with pytest.raises(QinferError, match=r"unsupported GGUF architecture 'qwen2'; supported: gemma3, llama"):
        _convert(tmp_path, path)


def test_unknown_tensor_and_missing_tensor(tmp_path):
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    tensors = llamacpp_tensors(model, "llama")
    extra = write_gguf(tmp_path / "extra.gguf", "llama", model.config,
                       {**tensors, "rope_freqs.weight": np.ones(8, np.float32)}, vocab)
    with pytest.raises(QinferError, match="unexpected tensor 'rope_freqs.weight'"):
        _convert(tmp_path, extra)
    del tensors["blk.1.ffn_up.weight"]
    missing = write_gguf(tmp_path / "missing.gguf", "llama", model.config, tensors, vocab)
    out = tmp_path / "out2"
    out.mkdir()
    with pytest.raises(QinferError, match="lacks 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"):
        convert_gguf(missing, out)


def _corrupt_cases():
    """A GGUF damaged or exported oddly in each way a converter meets, and the line that names it."""
    return {
        "string number": ({"extra": {"llama.rope.freq_base": "abc"}}, "llama.rope.freq_base = 'abc', not a number"),
        "array count": ({"extra": {"llama.attention.head_count_kv": [4, 4]}}, "head_count_kv = [4, 4], not an integer"),
        "heads": ({"extra": {"llama.attention.head_count": 2, "llama.attention.head_count_kv": 2}},
                  "blk.0.attn_q.weight is 64x64 where its llama.* hyperparameters imply 32x64"),
        "ffn": ({"extra": {"llama.feed_forward_length": 100}}, "blk.0.ffn_gate.weight is 96x64 where its llama.* hyperparameters imply 100x64"),
        "norm": ({"tensors": {"blk.0.attn_norm.weight": np.ones((2, 64), np.float32)}}, "attn_norm.weight is 2x64 where"),
        "bias": ({"tensors": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}}, "unexpected tensor 'blk.0.attn_q.bias'"),
        "f64": ({"tensors": {"blk.0.ffn_up.weight": None}}, "blk.0.ffn_up.weight is stored as F64"),
        "merge": ({"merges": ["abc"]}, "tokenizer.ggml.merges has 'abc', not two tokens of its vocabulary"),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases()))
def test_a_corrupt_or_odd_gguf_is_one_line_and_not_cached(tmp_path, case):
    change, message = _corrupt_cases()[case]
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    tensors = llamacpp_tensors(model, "llama")
    for name, t in change.get("tensors", {}).items():
        tensors[name] = tensors[name].astype(np.float64) if t is None else t
    if "merges" in change:
        vocab = {**vocab, "tokenizer.ggml.merges": change["merges"] + vocab["tokenizer.ggml.merges"]}
    path = write_gguf(tmp_path / "odd.gguf", "llama", model.config, tensors, vocab, extra=change.get("extra"))
    cache = tmp_path / "cache"
    assert_one_line_error(run_qinfer("generate", str(path), "hi", env={"QINFER_CACHE": str(cache)}), message)
    assert not any((cache / "converted").iterdir())


def test_a_gguf_string_that_is_not_utf8_is_one_line(tmp_path):
    vocab = bpe_vocab_metadata()
    model = tiny_llama(len(vocab["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path / "odd.gguf", "llama", model.config, llamacpp_tensors(model, "llama"), vocab,
                      extra={"general.name": "QQQQQQQQ"})
    path.write_bytes(path.read_bytes().replace(b"QQQQQQQQ", b"\xff\xfe\xfd\xfc" * 2))  # a damaged string
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(QinferError, match="odd.gguf is corrupt .* download it again"):
        convert_gguf(path, out)


def test_out_dir_must_be_empty(tmp_path, llama_case):
    _, path = llama_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    with pytest.raises(QinferError, match="existing, empty folder"):
        convert_gguf(path, out)


# --- the real built-in models (slow; need the GGUF files) ----------------------------------------------------



def _real(name: str) -> Path:
    return builtin_gguf(name)


def _greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_real_gemma3_270m_knows_paris(tmp_path):
    from qinfer.sources.tokenizer import Tokenizer

    out = _convert(tmp_path, _real("gemma-3-270m-q4_k_m.gguf"), dtype=torch.bfloat16)
    tok = Tokenizer.from_folder(out)
    assert (tok.bos_id, tok.eos_ids) == (2, (1, 106))
    # This Q4_K_M base model continues "The capital of France is" with " the capital of..." (" Paris" is its
    # third choice, the same in transformers' own GGUF loader); a question/answer prompt is unambiguous.
    ids = tok.encode("Question: What is the capital of France?\nAnswer:")
    assert tok.decode(_greedy(out, ids, 3)).startswith(" Paris")


@pytest.mark.slow
def test_real_smollm2_135m_chat_knows_paris(tmp_path):
    from qinfer.sources.tokenizer import Tokenizer

    out = _convert(tmp_path, _real("SmolLM2-135M-Instruct.Q4_1.gguf"), dtype=torch.bfloat16)
    tok = Tokenizer.from_folder(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert "Paris" in tok.decode(_greedy(out, tok.encode(prompt), 12))


def test_a_damaged_conversion_in_the_cache_is_made_again(llama_case, monkeypatch):
    """A cached conversion (a .gguf given as MODEL, or a built-in) with a file missing or cut short is
    converted again on next use instead of failing with advice that cannot be followed."""
    _, path = llama_case
    folder = resolve_model(str(path))
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:1000])
    leftover = folder.parent / f".{folder.name}.old-999998-abc"  # what a replace killed outright leaves
    shutil.copytree(folder, leftover)
    listed = CliRunner().invoke(cli, ["list"]).output
    assert f"{folder} damaged (model.safetensors has 1000 bytes, not the {len(good)} written)" in listed
    assert leftover.name not in listed
    shutil.rmtree(leftover)
    assert resolve_model(str(path)) == folder and weights.read_bytes() == good

    monkeypatch.setattr(registry, "fetch_gguf", lambda spec, force=False: path)
    name = "smollm2-135m-instruct"
    pulled = registry.pull(name)
    assert registry.is_pulled(name)
    (pulled / "tokenizer.json").unlink()
    assert not registry.is_pulled(name)
    assert registry.pull(name) == pulled and (pulled / "tokenizer.json").is_file() and registry.is_pulled(name)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = registry.cache_dir() / f"{registry.PULL_TEMP}{int(dead.stdout)}-abc"  # a download killed outright
    killed.mkdir()
    assert registry.pull(name) == pulled and not killed.exists()  # swept even when nothing is fetched


def test_a_gguf_changed_where_its_ends_stay_is_converted_again(llama_case):
    # the key hashes the first and last MiB, so an edit between them (a re-exported fine-tune of a large model)
    # shows only in the modification time; this tiny file's ends cover all of it, so only the time moves here
    _, path = llama_case
    first = resolve_model(str(path))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = resolve_model(str(path))
    assert again != first and (again / "model.safetensors").is_file()
    assert resolve_model(str(path)) == again


def test_a_full_disk_while_writing_tensors_is_one_line(llama_case, monkeypatch):
    # what safetensors raises when a write fails for want of space (its own type, not an OSError)
    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    converted = registry.cache_dir() / "converted"
    before = set(converted.iterdir()) if converted.exists() else set()  # the cache is the session's
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    result = CliRunner().invoke(cli, ["generate", str(llama_case[1]), "hi"])
    assert result.exit_code == 1 and not isinstance(result.exception, safetensors.SafetensorError)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: disk full while writing {converted / 'llama-'}")  # the folder being written
    assert line.endswith(": free space and retry")
    assert set(converted.iterdir()) == before  # the temp folder went with it


def test_force_never_deletes_the_gguf_being_quantized(llama_case, tmp_path):
    _, path = llama_case  # tmp_path/llama.gguf
    (tmp_path / "config.json").write_text("{}")  # the folder looks like a model folder --force may replace
    cache = tmp_path / "cache"
    proc = run_qinfer("quantize", str(path), "-o", str(tmp_path), "--force", "--method", "rtn", "--group-size", "32",
                      env={"QINFER_CACHE": str(cache)})
    assert_one_line_error(proc, "holds the model being read")
    assert path.is_file() and not (cache / "converted").exists()  # refused before converting
