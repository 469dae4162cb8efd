"""Tiny GGUF files written the way llama.cpp's converter writes them, for fast conversion and tokenizer tests.

The HF → GGUF direction here is written out by hand from llama.cpp's tensor names and conventions (Q/K row
permutation for llama, ``1 + w`` norms for gemma3), independently of ``qinfer.sources.gguf_convert``'s table, so
that a round trip checks the converter rather than repeating it.
"""

from pathlib import Path

import gguf
import numpy as np
import torch

# --- vocabularies -------------------------------------------------------------------------------------------

SP_SPECIAL = [
    ("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3), ("<end_of_turn>", 3),
    # user-defined, spelled with real spaces as llama.cpp writes them
    ("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4),
]
SP_CHARS = "▁" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()é"
SP_WORDS = ["Hello", "▁Hello", "▁world", "The", "▁the", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁café", "▁123"]


def sp_vocab_metadata(bos_id: int = 2, eos_id: int = 1) -> dict:
    """A Gemma-like SentencePiece vocabulary as GGUF metadata (``tokenizer.ggml.*``), no dummy prefix."""
    tokens, types = [t for t, _ in SP_SPECIAL], [k for _, k in SP_SPECIAL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = list(SP_CHARS)
    for word in SP_WORDS:  # SentencePiece BPE needs every intermediate piece: add the prefixes, shortest first
        normal += [word[:k] for k in range(2, len(word) + 1) if word[:k] not in normal]
    tokens += normal
    types += [1] * len(normal)
    scores = [-1000.0] * (len(SP_SPECIAL) + 256) + [-float(i) for i in range(len(normal))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": bos_id,
        "tokenizer.ggml.eos_token_id": eos_id,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map (printable bytes map to themselves, the rest to U+0100+)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_WORDS = ["Hello", "Ġworld", "Ġthe", "Ġis", "12"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bpe_vocab_metadata(add_bos: bool = False, pre: str = "smollm") -> dict:
    """A SmolLM-like byte-level BPE vocabulary with merges, as GGUF metadata."""
    tokens = BPE_SPECIAL + list(byte_alphabet().values())
    merges = []
    for word in BPE_WORDS:
        for k in range(2, len(word) + 1):
            if word[:k] not in tokens:
                merges.append(f"{word[:k - 1]} {word[k - 1]}")
                tokens.append(word[:k])
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(BPE_SPECIAL) + [1] * (len(tokens) - len(BPE_SPECIAL)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


# --- models -------------------------------------------------------------------------------------------------


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
    )
    return _randomized(LlamaForCausalLM(config))


def tiny_gemma3(vocab_size: int, sliding_window: int = 4):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, rms_norm_eps=1e-6,
        max_position_embeddings=128, sliding_window=sliding_window, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return _randomized(Gemma3ForCausalLM(config))


def _randomized(model):
    """Random weights everywhere, norms included (Gemma initializes its norms to 0, which would hide a missing -1)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "norm" in name else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in behaviour."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's GGUF names, with llama.cpp's edits applied (fp32, HF row-major)."""
    cfg = model.config
    block = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    }
    if arch == "llama":
        block["post_attention_layernorm"] = "ffn_norm"
    else:
        block |= {
            "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm",
        }
    out = {}
    for name, t in model.state_dict().items():
        w = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            gguf_name = f"blk.{i}.{block['.'.join(rest[:-1])]}.weight"
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            w = llamacpp_permute(w, cfg.num_attention_heads)
        if arch == "llama" and gguf_name.endswith("attn_k.weight"):
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        out[gguf_name] = w.astype(np.float32)
    return out


def write_gguf(
    path: Path,
    arch: str,
    config,
    tensors: dict[str, np.ndarray],
    vocab: dict,
    quantize: tuple[str, ...] = (),
    extra: dict | None = None,
) -> Path:
    """Write a GGUF with ``{arch}.*`` hyperparameters from an HF config, the vocabulary and the tensors.

    Tensors whose name contains one of ``quantize`` are stored as Q8_0 (input dim must be a multiple of 32).
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    rope = config.rope_parameters
    w.add_float32(f"{arch}.rope.freq_base", (rope.get("full_attention") or rope)["rope_theta"])
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", config.head_dim)
        w.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    else:
        w.add_uint32(f"{arch}.rope.dimension_count", config.head_dim)
    for key, value in {**vocab, **(extra or {})}.items():
        _add_kv(w, key, value)
    for name, data in tensors.items():
        if any(q in name for q in quantize):
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_kv(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif key == "tokenizer.ggml.token_type":
        w.add_array(key, [int(v) for v in value])  # written as INT32 like llama.cpp's add_token_types
    else:
        w.add_array(key, list(value))
