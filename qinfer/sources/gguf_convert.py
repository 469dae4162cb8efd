"""Convert a GGUF file (llama.cpp) into a Hugging Face-style folder that transformers loads unchanged.

    convert_gguf(Path("model.gguf"), out_dir)   # out_dir exists and is empty

writes ``model.safetensors``, ``config.json``, ``generation_config.json`` and the tokenizer files
(``qinfer.sources.gguf_vocab``). Every tensor is dequantized to fp32 with ``gguf.quants.dequantize``, fixed up in
fp32, then cast to ``dtype`` (bf16 by default) — the folder is a plain unquantized checkpoint, and our own
quantizers start from it.

Three things llama.cpp's converter did to the weights are undone here:

* **Shape order.** GGUF lists dims fastest-first (``ne0`` = input features), so a GGUF ``[in, out]`` tensor
  is an HF ``[out, in]`` weight; ``GGUFReader`` already hands the data over in row-major ``[out, in]``.
* **Q/K row permutation** (``llama``). llama.cpp rotates adjacent pairs (GPT-J style) where HF's
  ``rotate_half`` rotates the first half of each head against the second, so its converter reordered the rows
  of ``q_proj``/``k_proj``: ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)``. We apply the inverse
  (Q with ``n_head``, K with ``n_head_kv``).
* **Norm offset** (``gemma3``). Gemma's RMSNorm computes ``x * (1 + w)`` and HF stores ``w``; llama.cpp
  stores ``1 + w``. We subtract 1 in fp32 before casting, where bf16 would lose the small ``w``.

Per-architecture knowledge is the ``ARCHS`` table: GGUF block tensor names → HF module paths, whether Q/K
were permuted, the norm offset and the ``config.json`` builder. Adding qwen2/qwen3/mistral is one entry
(qwen2: llama's names plus ``.bias`` on q/k/v, which ``_TENSOR_NAME`` would take, no permutation; qwen3:
``attn_q_norm``/``attn_k_norm``).
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np
import torch
from tqdm import tqdm

from qinfer.store.atomic import save_tensors
from qinfer.errors import QinferError
from qinfer.sources.gguf_vocab import GGUFVocab, SpecialTokens, resolve_special_tokens, write_tokenizer_files

# Tensors outside the blocks, the same for every architecture. `output` exists only when the head is untied.
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma 3 has four norms per block. Mind the names: llama.cpp's `ffn_norm` is the *pre*-FFN norm, and its
# `post_attention_norm` is HF's `post_attention_layernorm` (applied to the attention output, not before the MLP).
_GEMMA3_BLOCK = {
    **{k: v for k, v in _LLAMA_BLOCK.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class GGUFHParams:
    """The model hyperparameters a GGUF states under ``{arch}.*``."""

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    sliding_window: int | None
    rope_scaling: dict[str, Any] | None

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise QinferError(f"the GGUF states {name} = {getattr(self, name)}; the file is corrupt")
        if self.num_heads % self.num_kv_heads:
            raise QinferError(f"the GGUF states {self.num_heads} heads over {self.num_kv_heads} KV heads; corrupt file")

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], arch: str) -> "GGUFHParams":
        def get(key, default=None, kind=int):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise QinferError(f"the GGUF lacks {arch}.{key}; re-export it with a current llama.cpp converter")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or (kind is int and not float(value).is_integer()):
                what = "an integer" if kind is int else "a number"
                raise QinferError(f"the GGUF states {arch}.{key} = {value!r}, not {what}; the file is corrupt")
            return kind(value)

        hidden, heads = get("embedding_length"), get("attention.head_count")
        head_dim = get("attention.key_length", 0) or get("rope.dimension_count", 0)
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "none":
            rope_scaling = None
        elif scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor", kind=float)}
        else:
            raise QinferError(f"unsupported RoPE scaling {scaling_type!r} in the GGUF; supported: none, linear")
        window = meta.get(f"{arch}.attention.sliding_window")
        return cls(
            arch=arch,
            num_layers=get("block_count"),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim or (hidden // heads if heads > 0 else 0),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", kind=float)),
            rope_theta=_f32(get("rope.freq_base", 10000.0, kind=float)),
            context_length=get("context_length"),
            sliding_window=None if window is None else get("attention.sliding_window"),
            rope_scaling=rope_scaling,
        )


def _f32(x: float) -> float:
    """A GGUF float32 as the number it was written from: 1e-06, not 9.999999974752427e-07."""
    return float(str(np.float32(x)))


def _common_config(hp: GGUFHParams) -> dict[str, Any]:
    return {
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "rms_norm_eps": hp.rms_norm_eps,
        "max_position_embeddings": hp.context_length,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def llama_config(hp: GGUFHParams) -> dict[str, Any]:
    """``LlamaConfig`` fields. ``rope_parameters`` is transformers 5's spelling; ``rope_theta`` the older one."""
    rope = {"rope_type": "default", "rope_theta": hp.rope_theta}
    if hp.rope_scaling:
        rope.update(hp.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(hp),
        "hidden_act": "silu",
        "mlp_bias": False,
        "rope_theta": hp.rope_theta,
        "rope_scaling": None if not hp.rope_scaling else dict(hp.rope_scaling),
        "rope_parameters": rope,
    }


# Gemma 3 values a GGUF does not record (from the published Gemma 3 configs and llama.cpp's gemma3 code).
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer (i % 6 == 5) attends globally


def gemma3_config(hp: GGUFHParams) -> dict[str, Any]:
    """``Gemma3TextConfig`` fields, in transformers 5's ``rope_parameters`` form and the plain older keys."""
    layer_types = [
        "full_attention" if i % GEMMA3_SLIDING_WINDOW_PATTERN == GEMMA3_SLIDING_WINDOW_PATTERN - 1 else "sliding_attention"
        for i in range(hp.num_layers)
    ]
    full = {"rope_type": "default", "rope_theta": hp.rope_theta}
    if hp.rope_scaling:  # Gemma 3 4B+ scales only the global layers' RoPE (linear, factor 8)
        full.update(hp.rope_scaling)
    # Attention scale: 1/sqrt(head_dim) for every size except 27B (62 layers), which uses
    # 1/sqrt(hidden/heads) = 1/sqrt(168); llama.cpp makes the same exception.
    query_pre_attn_scalar = hp.hidden_size // hp.num_heads if hp.num_layers == 62 else hp.head_dim
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_common_config(hp),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": hp.sliding_window or 512,
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "layer_types": layer_types,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "rope_theta": hp.rope_theta,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_scaling": None if not hp.rope_scaling else dict(hp.rope_scaling),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
    }


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto its transformers model."""

    block_tensors: Mapping[str, str]  # GGUF `blk.{i}.<key>` → HF `model.layers.{i}.<value>`
    permute_qk: bool  # llama.cpp reordered Q/K rows for its pairwise RoPE
    norm_offset: float  # llama.cpp stored every RMSNorm weight as `w + norm_offset`
    hf_config: Callable[[GGUFHParams], dict[str, Any]]


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(_LLAMA_BLOCK, permute_qk=True, norm_offset=0.0, hf_config=llama_config),
    "gemma3": GGUFArch(_GEMMA3_BLOCK, permute_qk=False, norm_offset=1.0, hf_config=gemma3_config),
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: pairwise-RoPE row order → HF's ``rotate_half`` order.

    Within each head llama.cpp has rows ``(d0, d_half, d1, d_half+1, ...)``; HF wants ``(d0, d1, ..., d_half, ...)``.
    Works on a ``[out, in]`` weight or an ``[out]`` bias.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A ``GGUFReader`` over ``path``, or a ``QinferError`` that says what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise QinferError(f"{path}: no such file; check the path")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise QinferError(f"{path} is not a GGUF file (no 'GGUF' magic at its start); pass a .gguf model file")
    try:
        return gguf.GGUFReader(path)
    # The reader has no error type of its own: a short file surfaces as numpy/struct errors at whatever
    # field or tensor runs past the end.
    except (ValueError, IndexError, OverflowError, struct.error, UnicodeDecodeError) as e:
        raise QinferError(f"{path} is truncated or corrupt ({e}); download it again") from e


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except (ValueError, UnicodeDecodeError) as e:  # a string that is not UTF-8: a damaged byte
        raise QinferError(f"{reader.data.filename} is corrupt ({e}); download it again") from e


_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.weight")  # no biases: neither architecture has one


def hf_tensor_name(name: str, arch: GGUFArch, num_layers: int) -> str:
    """The transformers state-dict key for GGUF tensor ``name``."""
    m = _TENSOR_NAME.fullmatch(name)
    if m:
        layer, key = m.groups()
        if layer is None and key in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[key]}.weight"
        if layer is not None and key in arch.block_tensors and int(layer) < num_layers:
            return f"model.layers.{layer}.{arch.block_tensors[key]}.weight"
    raise QinferError(f"unexpected tensor {name!r} in the GGUF; this conversion does not support it")


def _expected_shape(name: str, hp: GGUFHParams) -> tuple[int | None, ...]:
    """The shape of HF weight ``name`` that ``hp`` implies; None: any (the vocabulary's rows)."""
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    H, q, kv, inner = hp.hidden_size, hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim, hp.intermediate_size
    shapes = {"embed_tokens": (None, H), "lm_head": (None, H), "q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H),
              "o_proj": (H, q), "gate_proj": (inner, H), "up_proj": (inner, H), "down_proj": (H, inner),
              "q_norm": (hp.head_dim,), "k_norm": (hp.head_dim,)}
    return shapes.get(module, (H,))  # the other norms


def convert_tensor(tensor: gguf.ReaderTensor, arch: GGUFArch, hp: GGUFHParams) -> torch.Tensor:
    """Dequantize one ``ReaderTensor`` to fp32 ``[out, in]``, undo llama.cpp's edits. Returns fp32."""
    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:  # F64 and the integer types: no model's weights
        raise QinferError(f"the GGUF's {tensor.name} is stored as {tensor.tensor_type.name}, which this conversion "
                          "does not read; re-export it as F32, F16, BF16 or a llama.cpp quant type") from None
    data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # ne0 is the last (fastest) dim
    if not data.flags.writeable:  # F32 tensors come back as a view of the read-only memory map
        data = data.copy()
    w = torch.from_numpy(data).float()
    key = _TENSOR_NAME.fullmatch(tensor.name).group(2)
    if arch.permute_qk and key == "attn_q":
        w = unpermute_qk(w, hp.num_heads)
    elif arch.permute_qk and key == "attn_k":
        w = unpermute_qk(w, hp.num_kv_heads)
    if arch.norm_offset and key.endswith("norm"):
        w = w - arch.norm_offset
    return w


def _expected_names(arch: GGUFArch, hp: GGUFHParams) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(hp.num_layers):
        names |= {f"model.layers.{i}.{v}.weight" for v in arch.block_tensors.values()}
    return names


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the HF folder for ``gguf_path`` into the existing, empty ``out_dir``.

    Raises ``QinferError`` for a file that is not a GGUF, is truncated, or has an unsupported architecture.
    Callers that need an all-or-nothing folder wrap this in ``qinfer.store.atomic.atomic_dir``.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or any(out_dir.iterdir()):
        raise QinferError(f"{out_dir} must be an existing, empty folder to convert into")
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHS:
        raise QinferError(
            f"unsupported GGUF architecture {arch_name!r}; supported: {', '.join(sorted(ARCHS))}"
            " (add it to qinfer.sources.gguf_convert.ARCHS)"
        )
    arch = ARCHS[arch_name]
    hp = GGUFHParams.from_metadata(meta, arch_name)
    vocab = GGUFVocab.from_metadata(meta)
    specials = resolve_special_tokens(vocab)

    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {Path(gguf_path).name}", unit="tensor"):
        name = hf_tensor_name(tensor.name, arch, hp.num_layers)
        shape, want = tuple(int(d) for d in reversed(tensor.shape)), _expected_shape(name, hp)
        if len(shape) != len(want) or any(w is not None and d != w for d, w in zip(shape, want)):
            implied = "x".join("V" if w is None else str(w) for w in want)
            raise QinferError(f"the GGUF's {tensor.name} is {'x'.join(map(str, shape))} where its {arch_name}.* "
                              f"hyperparameters imply {implied}; the file is corrupt or not a standard export")
        tensors[name] = convert_tensor(tensor, arch, hp).to(dtype)
    missing = _expected_names(arch, hp) - tensors.keys()
    if missing:
        raise QinferError(f"the GGUF lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}; the file is incomplete")
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    if len(vocab.tokens) > vocab_size:
        raise QinferError(f"the GGUF has {len(vocab.tokens)} tokens but {vocab_size} embeddings; corrupt file")

    save_tensors(tensors, out_dir / "model.safetensors")
    config = hf_config(arch, hp, specials, vocab_size, tied="lm_head.weight" not in tensors, dtype=dtype)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(specials))
    write_tokenizer_files(vocab, specials, out_dir)


def hf_config(
    arch: GGUFArch, hp: GGUFHParams, specials: SpecialTokens, vocab_size: int, tied: bool, dtype: torch.dtype
) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        **arch.hf_config(hp),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": specials.bos_id,
        "eos_token_id": specials.eos_id,
        "pad_token_id": specials.pad_id,
        # transformers 5 reads `dtype` and warns about `torch_dtype`; older versions read only `torch_dtype`.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def generation_config(specials: SpecialTokens) -> dict[str, Any]:
    stops = list(specials.stop_ids)
    return {
        "bos_token_id": specials.bos_id,
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
        "pad_token_id": specials.pad_id,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
