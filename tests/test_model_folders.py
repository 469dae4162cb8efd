"""A user's Hugging Face model folder: which weight files and config.json settings are read, and which are
refused in one line instead of being run wrongly."""

import json
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qinfer.model.arch import ModelConfig
from qinfer.errors import QinferError
from qinfer.format import QuantScheme
from qinfer.model.loader import INDEX_FILE, load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.test_cli_errors import assert_one_line_error, run_qinfer
from tests.tiny_models import COMMON, CONFIGS, TEXT, VOCAB, make_model, write_tokenizer

REFUSED = [
    ("llama", {"attention_bias": True}, "attention_bias: true, biases on the attention linears"),
    ("qwen3", {"attention_bias": True}, "attention_bias: true"),
    ("llama", {"mlp_bias": True}, "mlp_bias: true, biases on the MLP linears"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping: 30.0"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: 50.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ("llama", {"hidden_act": "relu2"}, "hidden_act 'relu2' is not supported"),
    ("gemma3", {"hidden_activation": "quick_gelu"}, "hidden_activation 'quick_gelu' is not supported"),
    ("gemma3", {"layer_types": ["chunked_attention"] * 3}, "layer_types 'chunked_attention'"),
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal model"),
    ("llama", {"architectures": ["Phi3ForCausalLM"]}, "architectures (Phi3ForCausalLM) is not the llama decoder"),
    ("qwen2", {"architectures": ["Qwen2ForSequenceClassification"]}, "not the qwen2 decoder"),
    ("gemma3", {"architectures": ["Gemma3Model"]}, "not the gemma3_text decoder its model_type names"),
]


@pytest.mark.parametrize("kind, overrides, message", REFUSED, ids=[f"{k}-{next(iter(o))}" for k, o, _ in REFUSED])
def test_settings_the_decoder_does_not_implement_are_refused(kind, overrides, message):
    raw = {**CONFIGS[kind]().to_dict(), **overrides}
    with pytest.raises(QinferError, match="config.json") as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    ({"model_type": ["llama"]}, 'model_type is ["llama"], not a string'),
    ({"text_config": "x"}, 'text_config is "x", not an object'),
    ({"architectures": [1]}, "architectures is [1], not a list of class names"),
    ({"architectures": "LlamaForCausalLM"}, 'architectures is "LlamaForCausalLM", not a list'),
])
def test_malformed_config_values_are_one_line(overrides, message):
    with pytest.raises(QinferError, match=re.escape(message)):
        ModelConfig.from_dict({**CONFIGS["llama"]().to_dict(), **overrides})


@pytest.mark.parametrize("kind, architectures", [
    ("llama", ["LLaMAForCausalLM"]),  # early Llama checkpoints' spelling
    ("llama", ["MistralForCausalLM"]),
    ("mistral", ["LlamaForCausalLM"]),
    ("qwen3", ["Qwen3ForCausalLM"]),
    ("gemma3", ["Gemma3ForCausalLM"]),
    ("llama", []),
])
def test_the_causal_lm_classes_of_a_model_type_are_read(kind, architectures):
    raw = {**CONFIGS[kind]().to_dict(), "architectures": architectures}
    assert ModelConfig.from_dict(raw).model_type == CONFIGS[kind]().model_type


def _shard(folder, extra: dict | None = None):
    """Split folder's model.safetensors into two shards with an index, plus ``extra`` files the index omits."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for file, stale in (extra or {}).items():
        save_file({k: t * 2 for k, t in stale.items()}, folder / file)
    return tensors


def test_the_index_decides_which_shards_are_read(tmp_path):
    """A file the index does not list (a stale shard, Mistral's consolidated.safetensors) is not read."""
    ref = make_model("llama", tmp_path / "ref")
    folder = tmp_path / "ref"
    tensors = load_file(folder / "model.safetensors")
    layer0 = {k: t for k, t in tensors.items() if k.startswith("model.layers.0.")}
    _shard(folder, {"model-00099-of-00099.safetensors": layer0, "consolidated.safetensors": layer0})
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(load_model(folder, dtype=torch.float32)(ids), ref(ids).logits, atol=2e-4, rtol=2e-4)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(QinferError, match="model-00002-of-00002.safetensors .listed in model.safetensors.index.json. is missing"):
        load_model(folder)


def test_model_safetensors_is_read_without_an_index(tmp_path):
    ref = make_model("llama", tmp_path)
    stale = {k: t for k, t in load_file(tmp_path / "model.safetensors").items() if k.startswith("model.layers.1.")}
    save_file({k: t * 2 for k, t in stale.items()}, tmp_path / "adapter_model.safetensors")
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path, dtype=torch.float32)(ids), ref(ids).logits, atol=2e-4, rtol=2e-4)


def test_model_safetensors_beside_an_index_is_what_transformers_reads(tmp_path):
    ref = make_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    _shard(tmp_path)  # shards of the same weights, then a model.safetensors that differs from them
    save_file({k: t * 2 if k.startswith("model.layers.1.") else t for k, t in tensors.items()},
              tmp_path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        ours, expected = load_model(tmp_path, dtype=torch.float32)(ids), theirs(ids).logits
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)
        assert not torch.allclose(expected, ref(ids).logits, atol=1e-2)  # not the shards' weights


@pytest.mark.parametrize("kind", ["dangling link", "folder"])
def test_a_weight_file_that_cannot_be_read_is_one_line(tmp_path, kind):
    make_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    if kind == "folder":
        (tmp_path / "model.safetensors").mkdir()
    else:  # a Hugging Face cache snapshot whose blob is gone
        (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123")
    what = "not a file" if kind == "folder" else "a link to a missing file"
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), f"model.safetensors is {what}: re-download")


@pytest.mark.parametrize("layout", ["no model. prefix", "model.model. prefix", "tied, stored as lm_head only"])
def test_weight_names_transformers_maps_onto_its_model_are_read(tmp_path, layout):
    """Checkpoints saved from the base model, or wrapped once more, and a tied table stored under the lm_head's
    name: transformers adds or strips its base_model_prefix, and ties from either name."""
    ref = make_model("qwen2", tmp_path)  # tie_word_embeddings: true
    tensors = load_file(tmp_path / "model.safetensors")
    if layout == "tied, stored as lm_head only":
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        rename = (lambda k: k.removeprefix("model.")) if layout == "no model. prefix" else (lambda k: f"model.{k}")
        tensors = {rename(k): t for k, t in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)(ids).logits
        torch.testing.assert_close(expected, ref(ids).logits)
        torch.testing.assert_close(load_model(tmp_path, dtype=torch.float32)(ids), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_a_head_of_its_own_beside_a_tied_config_is_kept_as_transformers_keeps_it(tmp_path, calib_file,
                                                                                   quantize_lm_head):
    """A fine-tune that trained the lm_head and kept the base config's tie_word_embeddings: transformers (5.x)
    does not tie two different stored tables, and neither does qinfer, nor the folder it quantizes them into."""
    make_model("qwen2", tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 0.5 * torch.randn_like(
        tensors["model.embed_tokens.weight"])
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 97, (1, 11))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    assert theirs.lm_head.weight is not theirs.model.embed_tokens.weight
    ours = load_model(tmp_path / "src", dtype=torch.float32)
    assert not ours.tied
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=2e-4, rtol=2e-4)
    out = tmp_path / "q8"
    flags = ["--quantize-lm-head"] if quantize_lm_head else []
    result = run_qinfer("quantize", str(tmp_path / "src"), "--bits", "8", "--method", "rtn", "--group-size", "32",
                        "--calib", str(calib_file), "--samples", "2", "--seq-len", "16", *flags, "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "model.embed_tokens.weight" in load_file(out / "model.safetensors")
    with torch.no_grad():
        expected, quantized = theirs(ids).logits, load_model(out, dtype=torch.float32)(ids)
        tied = theirs.model(ids).last_hidden_state @ theirs.model.embed_tokens.weight.T  # had the config been obeyed
    assert (quantized - expected).abs().max() < 0.1 * (tied - expected).abs().max()


@pytest.mark.parametrize("source", ["config.json", "generation_config.json"])
def test_the_tokenizers_own_bos_wins_over_a_config_id_that_disagrees(tmp_path, source):
    """transformers' tokenizer adds the BOS token tokenizer_config.json names, whatever id the configs hold."""
    make_model("llama", tmp_path)  # BOS <s> = 0 in every file
    path = tmp_path / source
    path.write_text(json.dumps({**json.loads(path.read_text()), "bos_token_id": 5}))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    for text in ("It is", " a", ""):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode("It is")[0] == ours.leading_bos == 0


def test_an_untied_model_without_its_lm_head_is_refused(tmp_path):
    make_model("llama", tmp_path)  # tie_word_embeddings: false
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: t for k, t in tensors.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(QinferError, match="missing lm_head.weight"):
        load_model(tmp_path)


def test_a_weight_of_integers_is_refused_in_one_line(tmp_path):
    make_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    message = f"{name} holds int32 values, not floating point ones: the checkpoint is damaged"
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), message)
    assert_one_line_error(run_qinfer("quantize", str(tmp_path), "-o", str(tmp_path / "q"), "--method", "rtn"), message)


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_one_line(tmp_path):
    """Another model's tokenizer: the first id without an embedding row is named, not an IndexError (one far
    larger than the model is refused as it loads)."""
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 40})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    with pytest.raises(QinferError, match=f"tokenizer has {VOCAB} tokens but config.json vocab_size is 40"):
        Tokenizer.from_folder(tmp_path)
    rows = VOCAB - 40  # a tokenizer a little larger than the model: refused at the first id past its rows
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": rows})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    low = [c for c in TEXT if (tok.token_to_id(c) or rows) < rows]
    assert low and tok.encode(low[0])  # ids below the rows pass
    with pytest.raises(QinferError):
        tok.encode(TEXT)
    assert_one_line_error(
        run_qinfer("generate", str(tmp_path), "It is a truth universally acknowledged", "--max-tokens", "2"),
        "(config.json vocab_size)", "are not this model's",
    )
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path)], input="hello\n",
                          capture_output=True, text=True, timeout=300)  # refused at start, not at every turn
    assert_one_line_error(chat, "this model cannot take a first chat turn", "are not this model's")


@pytest.mark.parametrize("place, fix", [("models/smollm2-135m-instruct", "`qinfer pull smollm2-135m-instruct --force`"),
                                        ("converted/m-0123", "delete "), ("elsewhere/m", "re-download or re-convert"),
                                        ("quantized/m-rtn", "`qinfer demo` quantizes"),
                                        ("elsewhere/q", "quantize the model again")])
def test_a_truncated_weight_file_names_the_fix_for_where_it_is(tmp_path, monkeypatch, place, fix):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / place
    make_model("llama", folder)
    if place.endswith(("rtn", "/q")):  # a quantized folder (the weights need not be packed for this)
        (folder / "quant_config.json").write_text(QuantScheme(method="rtn").to_json())
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QinferError, match="is truncated") as e:
        load_model(folder)
    assert fix in str(e.value)


def test_a_folder_named_like_a_built_in_gets_a_note(tmp_path, monkeypatch, capsys):
    # the name means the built-in (so it can always be named); the folder of that name here is pointed out
    import qinfer.sources.resolve

    monkeypatch.setattr(qinfer.sources.resolve, "pull", lambda name: tmp_path / "cache" / name)
    monkeypatch.chdir(tmp_path)
    assert qinfer.sources.resolve.resolve_model("gemma3-270m") == tmp_path / "cache" / "gemma3-270m"
    assert capsys.readouterr().err == ""
    make_model("llama", tmp_path / "gemma3-270m")
    for _ in range(2):
        assert qinfer.sources.resolve.resolve_model("gemma3-270m") == tmp_path / "cache" / "gemma3-270m"
    assert capsys.readouterr().err.count("write ./gemma3-270m for it") == 1
    assert qinfer.sources.resolve.resolve_model("./gemma3-270m").resolve() == tmp_path / "gemma3-270m"
