"""Architecture table and model configuration.

Every difference between the supported decoder families lives in one ``ArchSpec`` row; the decoder, the
quantize pipeline and AWQ's scale folding read the row instead of matching class or tensor names.
``ModelConfig`` is the validated, architecture-neutral reading of a Hugging Face ``config.json``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from qinfer.errors import QinferError
from qinfer.store.reading import read_json_object


@dataclass(frozen=True)
class LinearGroup:
    """Linears of one decoder block that read the same input.

    ``norm`` names the RMSNorm that produces that input (AWQ folds input scales into it); ``prev`` names
    the linear whose output is the input instead (v_proj feeds o_proj, up_proj feeds down_proj), for
    folding into that linear's rows. Exactly one of them is set.
    """

    linears: tuple[str, ...]
    norm: str | None = None
    prev: str | None = None


@dataclass(frozen=True)
class ArchSpec:
    """How one decoder family differs from plain Llama."""

    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma stores w around 0
    norm_scale_in_fp32: bool = False  # Gemma: (x * (1 + w)).to(dtype); Llama: x.to(dtype) * w
    sandwich_norms: bool = False  # Gemma: extra norms after attention and after the MLP
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    qkv_bias: bool = False  # Qwen2
    activation: str = "silu"  # gate activation of the gated MLP, unless config.json names another
    activation_key: str = "hidden_act"  # the config.json key that names it
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    mlp_norm: str = "post_attention_layernorm"  # the norm that feeds the MLP

    @property
    def linear_groups(self) -> tuple[LinearGroup, ...]:
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        return (
            LinearGroup(attn, norm="input_layernorm"),
            LinearGroup(("self_attn.o_proj",), prev="self_attn.v_proj"),
            LinearGroup(("mlp.gate_proj", "mlp.up_proj"), norm=self.mlp_norm),
            LinearGroup(("mlp.down_proj",), prev="mlp.up_proj"),
        )

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(name for group in self.linear_groups for name in group.linears)


LLAMA = ArchSpec()
ARCHS: dict[str, ArchSpec] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=True),
    "gemma3_text": ArchSpec(
        norm_offset=1.0,
        norm_scale_in_fp32=True,
        sandwich_norms=True,
        qk_norm=True,
        activation="gelu_tanh",
        activation_key="hidden_activation",
        embed_scale=True,
        mlp_norm="pre_feedforward_layernorm",
    ),
}
# config.json model_type values that are the same decoder under another name.
MODEL_TYPE_ALIASES = {"gemma3": "gemma3_text"}
# The transformers classes (config.json "architectures", case aside) each model type's decoder computes.
CAUSAL_LM_CLASSES = {
    "llama": ("LlamaForCausalLM", "MistralForCausalLM"),
    "mistral": ("MistralForCausalLM", "LlamaForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma3_text": ("Gemma3ForCausalLM",),
}
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' activation names (ACT2FN) -> the gate activation the decoder computes.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# config.json settings that change what a supported family computes and that qinfer's decoder does not implement:
# (model types, key, what the setting adds). A null or false value is the plain model.
UNSUPPORTED = (
    (("llama", "mistral", "qwen3", "gemma3_text"), "attention_bias", "biases on the attention linears"),
    (("llama",), "mlp_bias", "biases on the MLP linears"),
    (("gemma3_text",), "final_logit_softcapping", "soft-capped logits"),
    (("gemma3_text",), "attn_logit_softcapping", "soft-capped attention scores"),
    (("gemma3_text",), "use_bidirectional_attention", "bidirectional attention (an embedding model, not a decoder)"),
)
# Defaults transformers assumes where config.json leaves these out.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2/Qwen3: layers below this one attend fully even with use_sliding_window
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # Gemma 3 configs without layer_types: every 6th layer is global


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise QinferError(f"unsupported rope scaling type {self.kind!r}; qinfer supports {', '.join(ROPE_TYPES)}")


def read_config(folder: Path) -> dict:
    """``folder``'s config.json as a dict, or one line naming what is wrong with it."""
    try:
        return read_json_object(Path(folder) / "config.json", "copy the model's config.json again")
    except FileNotFoundError:
        raise QinferError(f"{folder} has no config.json: point qinfer at a Hugging Face model folder") from None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: tuple[RopeConfig, ...]  # one per layer: Gemma 3's local layers have their own base
    sliding_window: tuple[int | None, ...]  # one per layer; None = full causal attention
    attn_scale: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    activation: str = "silu"  # one of ACTIVATIONS' values
    bos_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise QinferError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if len(self.rope) != self.num_layers or len(self.sliding_window) != self.num_layers:
            raise QinferError("config.json: per-layer rope/sliding-window settings do not match num_hidden_layers")

    @property
    def arch(self) -> ArchSpec:
        return ARCHS[self.model_type]

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        return cls.from_dict(read_config(folder))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        text = raw.get("text_config") or {}
        if not isinstance(text, dict):
            raise QinferError(f"config.json's text_config is {json.dumps(text)}, not an object; copy the model's "
                              "config.json again")
        raw = dict(text, **{k: v for k, v in raw.items() if k != "text_config"})
        if not isinstance(raw.get("model_type", ""), str):
            raise QinferError(f"config.json's model_type is {json.dumps(raw['model_type'])}, not a string; copy the "
                              "model's config.json again")
        model_type = MODEL_TYPE_ALIASES.get(raw.get("model_type"), raw.get("model_type"))
        if "model_type" not in raw:
            raise QinferError("config.json has no model_type: it is not a Hugging Face model config; copy the "
                              f"model's own (qinfer runs {', '.join(sorted(ARCHS))})")
        if model_type not in ARCHS:
            raise QinferError(
                f"unsupported architecture {raw.get('model_type')!r} (config.json model_type); "
                f"qinfer runs {', '.join(sorted(ARCHS))}"
            )
        try:
            _check_supported(raw, model_type)
            n_layers = int(raw["num_hidden_layers"])
            hidden = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // n_heads)
            layer_types, window = _layer_types(raw, model_type, n_layers)
            rope_global, rope_local = _rope_configs(raw, model_type)
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=n_layers,
                num_heads=n_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=tuple(rope_local if t == "sliding_attention" else rope_global for t in layer_types),
                sliding_window=tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types),
                # Gemma 3 scales by query_pre_attn_scalar (transformers' default 256, not head_dim); the others
                # by head_dim, whatever the config holds
                attn_scale=float((raw.get("query_pre_attn_scalar") or 256) if model_type == "gemma3_text"
                                 else head_dim) ** -0.5,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "gemma3_text")),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                activation=_activation(raw, ARCHS[model_type]),
                bos_token_id=raw.get("bos_token_id"),
            )
        except KeyError as e:
            raise QinferError(f"config.json lacks {e.args[0]!r}: is this a complete Hugging Face model config?") from None
        except (TypeError, ValueError) as e:
            raise QinferError(f"config.json has a malformed value: {e}") from None


def _check_supported(raw: dict, model_type: str) -> None:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise QinferError(f"config.json's architectures is {json.dumps(architectures)}, not a list of class names; "
                          "copy the model's config.json again")
    if raw.get("vision_config") or any("ConditionalGeneration" in a for a in architectures):
        raise QinferError(
            f"config.json describes a multimodal model ({', '.join(architectures) or 'vision_config'}); qinfer runs "
            "text-only decoders: use the text-only checkpoint (e.g. a *ForCausalLM one)"
        )
    known = {name.lower() for name in CAUSAL_LM_CLASSES[model_type]}
    if architectures and not any(a.lower() in known for a in architectures):
        raise QinferError(
            f"config.json's architectures ({', '.join(architectures)}) is not the {model_type} decoder its model_type "
            f"names ({' or '.join(CAUSAL_LM_CLASSES[model_type])}), so qinfer would compute another model: use a "
            "checkpoint of an architecture qinfer runs, with its own config.json"
        )
    for types, key, what in UNSUPPORTED:
        if model_type in types and raw.get(key):
            raise QinferError(
                f"config.json sets {key}: {json.dumps(raw[key])}, {what}, which qinfer's {model_type} decoder "
                "does not implement"
            )


def _activation(raw: dict, arch: ArchSpec) -> str:
    name = raw.get(arch.activation_key)
    if name is None:
        return arch.activation
    if name not in ACTIVATIONS:
        raise QinferError(
            f"config.json: {arch.activation_key} {name!r} is not supported; qinfer runs {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def _layer_types(raw: dict, model_type: str, n_layers: int) -> tuple[list[str], int | None]:
    """Each layer's attention ("full_attention" or "sliding_attention") and the sliding window, read as
    transformers reads them: Mistral slides in every layer when it has a window; Qwen2/Qwen3 only with
    ``use_sliding_window``, from layer ``max_window_layers`` on; Gemma 3 per ``layer_types``, or in older
    configs every ``sliding_window_pattern``-th layer global. Llama attends fully."""
    window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if model_type == "mistral":
        return ["sliding_attention" if window else "full_attention"] * n_layers, window
    if model_type in ("qwen2", "qwen3"):
        window = window if raw.get("use_sliding_window") else None
        first = int(raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS))
        default = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n_layers)]
    elif model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    else:
        return ["full_attention"] * n_layers, None
    types = list(raw.get("layer_types") or default)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise QinferError(f"config.json: layer_types {unknown[0]!r} is not supported; qinfer runs full_attention "
                          "and sliding_attention layers")
    return types, window


def _rope_configs(raw: dict, model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """(full-attention layers' RoPE, sliding layers' RoPE), from old-style or transformers-5-style keys, as
    transformers merges them: a non-null legacy ``rope_scaling`` wins over ``rope_parameters`` (updating the
    full-attention layers' entry where they are per layer type, as Gemma 3's config does)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per-layer-type dict (Gemma 3, tf 5)
        full, local = {**(params.get("full_attention") or {}), **scaling}, params.get("sliding_attention") or {}
    else:
        full = dict(scaling or params)
        local = {}
    default_global = 1_000_000.0 if model_type == "gemma3_text" else 10_000.0
    theta = float(full.get("rope_theta") or raw.get("rope_theta") or default_global)
    local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10_000.0)
    if model_type != "gemma3_text":
        local_theta, local = theta, full
    # the context the scaled RoPE was trained at, where the scaling entry leaves it out: transformers' default
    trained = int(raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings") or 8192)
    return _rope(full, theta, trained), _rope(local, local_theta, trained)


def _rope(scaling: dict, theta: float, trained: int) -> RopeConfig:
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings") or trained),
    )
