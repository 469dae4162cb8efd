"""Architecture table and model configuration.

Every difference between the supported decoder families lives in one ``ArchSpec`` row; the decoder, the
quantize pipeline and AWQ's scale folding read the row instead of matching class or tensor names.
``ModelConfig`` is the validated, architecture-neutral reading of a Hugging Face ``config.json``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from qinfer.errors import QinferError


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
    activation: str = "silu"  # gate activation of the gated MLP
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
        embed_scale=True,
        mlp_norm="pre_feedforward_layernorm",
    ),
}
# config.json model_type values that are the same decoder under another name.
MODEL_TYPE_ALIASES = {"gemma3": "gemma3_text"}
ROPE_TYPES = ("default", "linear", "llama3")


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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise QinferError(f"{folder} has no config.json: point qinfer at a Hugging Face model folder") from None
        except json.JSONDecodeError as e:
            raise QinferError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        raw = dict(raw.get("text_config") or {}, **{k: v for k, v in raw.items() if k != "text_config"})
        model_type = MODEL_TYPE_ALIASES.get(raw.get("model_type"), raw.get("model_type"))
        if model_type not in ARCHS:
            raise QinferError(
                f"unsupported architecture {raw.get('model_type')!r} (config.json model_type); "
                f"qinfer runs {', '.join(sorted(ARCHS))}"
            )
        try:
            n_layers = int(raw["num_hidden_layers"])
            hidden = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // n_heads)
            layer_types = raw.get("layer_types") or ["full_attention"] * n_layers
            window = raw.get("sliding_window")
            if model_type == "mistral" or (model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window")):
                layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
            rope_global, rope_local = _rope_configs(raw, model_type)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
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
                sliding_window=tuple(int(window) if t == "sliding_attention" else None for t in layer_types),
                attn_scale=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "gemma3_text")),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise QinferError(f"config.json lacks {e.args[0]!r}: is this a complete Hugging Face model config?") from None
        except (TypeError, ValueError) as e:
            raise QinferError(f"config.json has a malformed value: {e}") from None


def _rope_configs(raw: dict, model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """(full-attention layers' RoPE, sliding layers' RoPE), from old-style or transformers-5-style keys."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per-layer-type dict (Gemma 3, tf 5)
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        local = {}
    default_global = 1_000_000.0 if model_type == "gemma3_text" else 10_000.0
    theta = float(full.get("rope_theta") or raw.get("rope_theta") or default_global)
    local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10_000.0)
    if model_type != "gemma3_text":
        local_theta, local = theta, full
    return _rope(full, theta), _rope(local, local_theta)


def _rope(scaling: dict, theta: float) -> RopeConfig:
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )
