"""Tiny randomly initialised transformers models of each supported architecture (built from a config)."""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. 0123456789 ÄÖÜ éè — “quotes”.\n"
)
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
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
    with torch.no_grad():  # non-trivial norm weights and biases (zeros at init) so a mistake or loss shows up
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def write_tokenizer(folder) -> None:
    """A byte-level BPE tokenizer.json (<s> = 0 is BOS, </s> = 1 is EOS) trained on a paragraph of Austen."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "bos_token_id": 0, "eos_token_id": 1}))
