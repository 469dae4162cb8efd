"""Tiny randomly initialised transformers models of each supported architecture (built from a config)."""

import torch
import transformers

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=7, head_dim=16),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def make_model(kind: str, folder, dtype=torch.float32):
    """Save a random transformers model of ``kind`` to ``folder`` and return it (eval mode, fp32)."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    with torch.no_grad():  # non-trivial norm weights so an offset or scaling mistake shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model
