"""Our decoder against transformers on tiny random models of every supported architecture."""

import json

import pytest
import torch
import transformers

from qinfer.model.kv_cache import KVCache
from qinfer.model.loader import load_model
from tests.tiny_models import CONFIGS, make_model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    ref = make_model(kind, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_cached_decode_matches_full_forward(kind, tmp_path):
    make_model(kind, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, batch=1, max_len=32, dtype=torch.float32)
        steps = [model(ids[:, :9], torch.arange(9), cache)]
        for t in range(9, 16):
            steps.append(model(ids[:, t : t + 1], torch.tensor([t]), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_stored_bos_position_stands_in_for_the_models_own(kind, tmp_path):
    """set_bos: where position 0 holds BOS, the model attends to the stored keys and values there and outputs
    the stored hidden state; other rows, and a model given its own BOS position, are unchanged."""
    make_model(kind, tmp_path)
    source = load_model(tmp_path, dtype=torch.float32)
    model = load_model(tmp_path, dtype=torch.float32)
    bos = model.config.bos_token_id
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        for m in (source, model):  # Gemma's BOS (0) is its padding token, whose embedding is zero
            m.model.embed_tokens.weight[bos] = torch.randn(m.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(2, 97, (2, 12))
    ids[0, 0] = bos  # row 1 does not start with BOS
    with torch.no_grad():
        own, source_logits = model(ids), source(ids)
        model.set_bos(model.own_bos())
        torch.testing.assert_close(model(ids), own, atol=1e-5, rtol=1e-5)
        model.set_bos(source.own_bos())
        got = model(ids)
        cache = KVCache(model.config, batch=2, max_len=16, dtype=torch.float32)
        steps = [model(ids[:, :5], torch.arange(5), cache)]
        steps += [model(ids[:, t : t + 1], torch.tensor([t]), cache) for t in range(5, 12)]
    torch.testing.assert_close(got[0, 0], source_logits[0, 0], atol=1e-5, rtol=1e-5)  # the stored output
    assert (got[0, 1:] - own[0, 1:]).abs().max() > 1e-3  # later tokens attend to the stored K/V
    torch.testing.assert_close(got[1], own[1])  # no BOS: the model's own
    torch.testing.assert_close(torch.cat(steps, dim=1), got, atol=1e-4, rtol=1e-4)  # the same through a KV cache


# config.json spellings that decide which layers slide or which activation the MLP uses, as published configs
# write them: (architecture, keys set, keys removed). Each one changes the logits if it is read wrongly.
VARIANTS = {
    "gemma3-sliding-window-pattern": ("gemma3", {"sliding_window_pattern": 3}, ["layer_types"]),
    "qwen2-max-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, ["layer_types"]),
    "qwen3-max-window-layers": ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}, ["layer_types"]),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}, []),
    # transformers' Gemma 3 defaults query_pre_attn_scalar to 256 (not head_dim); Llama scales by head_dim always
    "gemma3-default-query-pre-attn-scalar": ("gemma3", {}, ["query_pre_attn_scalar"]),
    "llama-ignores-query-pre-attn-scalar": ("llama", {"query_pre_attn_scalar": 7}, []),
    "gemma3-silu": ("gemma3", {"hidden_activation": "silu"}, []),
    # a legacy rope_scaling added beside transformers 5's rope_parameters (as older guides say to) wins over it
    "llama-rope-scaling-beside-parameters": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, []),
    "gemma3-rope-scaling-beside-parameters": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, []),
    # llama3 scaling without original_max_position_embeddings: trained at max_position_embeddings
    "llama-llama3-rope-trained-context": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}}, []),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    kind, overrides, removed = VARIANTS[variant]
    make_model(kind, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(overrides)
    for key in removed:
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=2e-4, rtol=2e-4)
