"""The decoder: one module tree for every supported family, steered by the ``ArchSpec`` row.

Module names follow Hugging Face's (``model.layers.3.self_attn.q_proj``), so a checkpoint loads by name and
the quantize pipeline can address linears the way every other tool does. Every linear is a ``QLinear``:
the one seam through which quantized kernels come in. Shapes: B batch, T new tokens, S cached tokens,
H query heads, Hkv key/value heads, D head dim, C hidden size.
"""

import contextlib
import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qinfer.model.arch import ModelConfig, RopeConfig
from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.kernels.attention import attention
from qinfer.kernels.linear import linear, matmul_dtype, rowwise
from qinfer.kernels.norm import all_rows as norm_all_rows, norm_rows_max, rms_norm
from qinfer.model.decode_plan import Rows, plan_for
from qinfer.model.kv_cache import DecodeRows, KVCache


class QLinear(nn.Module):
    """A linear layer whose weight is either a dense tensor or a packed quantized weight.

    ``forward`` hands both to ``qinfer.kernels.linear``, which picks the kernel for the weight's format and
    the device; nothing else in the model knows how weights are stored.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def matmul_dtype(self, x_dtype: torch.dtype, device: torch.device, rows: int) -> torch.dtype:
        """The dtype ``forward`` multiplies in for ``rows`` rows of ``x_dtype`` on ``device`` (MFU's ceiling)."""
        return matmul_dtype(self.weight, x_dtype, device, rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={type(self.weight).__name__}"


class FusedLinear(nn.Module):
    """Linears that read one input, run as one: their weights stacked along the output rows (``stacked``).

    Built by :func:`fuse_linears`, which makes each member's weight (and bias) a view of its rows here, so
    nothing is stored twice. One call multiplies a decode step's rows by all of them (q/k/v: one kernel call
    instead of three; gemma3-270m's decode step: 72 calls into its blocks' linears instead of 126), where each
    row's outputs are their own sums (:meth:`runs`); prompts, and members that no longer hold the weights they
    were fused from (one replaced after fusing), run member by member.
    Not a ``QLinear``: walks over a model's linears (bytes, FLOPs, calibration hooks) see the members only;
    not in the state dict.
    """

    enabled = True  # off inside separate_linears()

    def __init__(self, members: list[QLinear], weight, views: list):
        super().__init__()
        self.sizes = [m.out_features for m in members]
        if isinstance(weight, torch.Tensor):
            self.register_buffer("weight", weight, persistent=False)
        else:
            self.weight = weight
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        self.register_buffer("bias", bias, persistent=False)
        for i, (m, view) in enumerate(zip(members, views)):
            m.weight = nn.Parameter(view, requires_grad=False) if isinstance(view, torch.Tensor) else view
            if bias is not None:
                m.bias = nn.Parameter(bias.split(self.sizes)[i], requires_grad=False)
        # plain tuples, not submodules: what each member held when fused
        self.members, self.parts = tuple(members), tuple((m.weight, m.bias) for m in members)

    def runs(self, x: torch.Tensor) -> bool:
        """Whether to multiply ``x`` here: rows whose every output is its own sum (one row, or rows the C GEMVs
        take: ``kernels.linear.rowwise``; then the members' outputs bit for bit, where a prompt's GEMM may sum in
        another order for another N), fusing on, and every member still holding the weight and bias it was fused
        with."""
        return (
            FusedLinear.enabled and rowwise(x, self.weight)
            and all(m.weight is w and m.bias is b for m, (w, b) in zip(self.members, self.parts))
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


@contextlib.contextmanager
def separate_linears():
    """Run fused linears one member at a time (to measure what fusing gains, side by side)."""
    before, FusedLinear.enabled = FusedLinear.enabled, False
    try:
        yield
    finally:
        FusedLinear.enabled = before


def stacked(weights: list) -> tuple[object, list] | None:
    """Weights of the same input size and form stacked along their output rows, as one weight ``[sum N, K]``,
    and each of them again as a view of its rows of it: ``(stacked, views)``; None where they do not stack
    (different types, dtypes, bit widths, group sizes, symmetry or column permutations). Dense tensors,
    ``QuantizedWeight`` and ``Fp8Weight`` stack; an FP8 per-tensor scale becomes one scale per row in the
    stacked weight (the same numbers), and each view keeps its own scale. A view holds the same numbers as the
    weight it replaces, so ``linear(x, stacked)`` is the members' outputs side by side."""
    first = weights[0]
    if any(type(w) is not type(first) or w.shape[1] != first.shape[1] for w in weights):
        return None
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w.shape[0])
    rows = lambda t: [t[a:b] for a, b in zip(bounds, bounds[1:])]  # noqa: E731
    if isinstance(first, torch.Tensor):
        if any(w.dtype != first.dtype or w.device != first.device for w in weights):
            return None
        whole = torch.cat(weights)
        return whole, rows(whole)
    if isinstance(first, Fp8Weight):
        codes = torch.cat([w.weight for w in weights])
        scale = torch.cat([w.scale.expand(w.shape[0], 1) for w in weights])
        views = [Fp8Weight(c, w.scale if w.granularity == "tensor" else s)
                 for c, s, w in zip(rows(codes), rows(scale), weights)]
        return Fp8Weight(codes, scale), views
    if isinstance(first, QuantizedWeight):
        same = (first.bits, first.group_size, first.symmetric)
        if any((w.bits, w.group_size, w.symmetric) != same or not _same_perm(w.perm, first.perm) for w in weights):
            return None
        qweight, scale = torch.cat([w.qweight for w in weights]), torch.cat([w.scale for w in weights])
        zero = None if first.symmetric else torch.cat([w.zero for w in weights])
        K = first.shape[1]
        whole = QuantizedWeight(qweight, scale, zero, first.bits, first.group_size, (bounds[-1], K), first.perm)
        zeros = [None] * len(weights) if zero is None else rows(zero)
        views = [QuantizedWeight(q, s, z, first.bits, first.group_size, (q.shape[0], K), first.perm)
                 for q, s, z in zip(rows(qweight), rows(scale), zeros)]
        return whole, views
    return None


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def fuse_linears(model: "Transformer") -> int:
    """Fuse each block's linears that read one input (the arch table's groups: q/k/v, gate/up) where their
    weights stack, as the owner's ``fused`` (:class:`FusedLinear`, members in the table's order): for a model
    that runs, not one being quantized. Returns how many groups were fused."""
    fused = 0
    for block in model.model.layers:
        for group in model.config.arch.linear_groups:
            owner = block.get_submodule(group.linears[0].rpartition(".")[0])  # self_attn, mlp
            members = [block.get_submodule(name) for name in group.linears]
            if len(members) < 2 or owner.fused is not None or len({m.bias is None for m in members}) > 1:
                continue
            found = stacked([m.weight for m in members])
            if found is not None:
                owner.fused = FusedLinear(members, *found)
                fused += 1
    return fused


class QEmbedding(nn.Module):
    """Token embeddings: a dense ``[V, C]`` table, or the packed weight of the quantized lm_head it is tied
    to, whose rows are dequantized on lookup into ``dtype`` (the format's tied embedding)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
        self.packed_dtype: torch.dtype | None = None

    def tie_to_packed(self, weight, dtype: torch.dtype) -> None:
        """Read rows from the packed ``weight`` (a quantized lm_head's) in ``dtype`` from now on."""
        del self._parameters["weight"]
        self.weight, self.packed_dtype = weight, dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype if self.packed_dtype is None else self.packed_dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_dtype is None:
            return F.embedding(input_ids, self.weight)
        return self.weight.rows(input_ids, self.packed_dtype)

    def extra_repr(self) -> str:
        return f"weight={type(self.weight).__name__}"


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + w)``.

    A norm that scales in fp32 (Gemma) may hold an fp32 weight, and keeps one it was given (see
    :meth:`weight_dtype`): AWQ's fold and the tuning stages move ``offset + w`` far from 1, where ``w``
    in bf16 loses the multiplier's precision (``w = -0.97`` keeps ``1 + w = 0.03`` only to ~7%).
    """

    def __init__(self, dim: int, eps: float, offset: float, scale_in_fp32: bool):
        super().__init__()
        self.eps, self.offset, self.scale_in_fp32 = eps, offset, scale_in_fp32
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.scale_in_fp32)

    def weight_dtype(self, dtype: torch.dtype, given: torch.dtype) -> torch.dtype:
        """The dtype to hold a ``given``-dtype weight in a ``dtype`` model: fp32 stays fp32 where the norm scales in fp32."""
        return torch.float32 if self.scale_in_fp32 and given == torch.float32 else dtype


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [T, D] from :meth:`Transformer.rope` (the rotate-half layout: pairs (i, i + D/2)).

    ``sin`` carries the rotation's signs (its first half negated), so ``x * cos + rotate_half(x) * sin`` is
    ``x * cos + roll(x, D/2) * sin``: the same numbers (a sign flip is exact) in 4 ops instead of 7.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        arch, C, D = config.arch, config.hidden_size, config.head_dim
        self.layer_idx, self.window = layer_idx, config.sliding_window[layer_idx]
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, D
        self.scale = config.attn_scale
        self.q_proj = QLinear(C, self.n_heads * D, bias=arch.qkv_bias)
        self.k_proj = QLinear(C, self.n_kv_heads * D, bias=arch.qkv_bias)
        self.v_proj = QLinear(C, self.n_kv_heads * D, bias=arch.qkv_bias)
        self.o_proj = QLinear(self.n_heads * D, C)
        self.fused: FusedLinear | None = None  # q/k/v run as one: see fuse_linears
        if arch.qk_norm:
            self.q_norm = _norm(config, D)
            self.k_norm = _norm(config, D)
        self.bos_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # the BOS token's keys, values: [Hkv, D] each

    def forward(self, x, cos, sin, mask, cache: KVCache | None, input_pos, bos=None, span=None):
        return self.o_proj(self.heads(x, cos, sin, mask, cache, input_pos, bos, span))

    def heads(self, x, cos, sin, mask, cache: KVCache | None, input_pos, bos=None, span=None):
        """The attention's output before ``o_proj`` (its input): [B, T, heads * head_dim].

        ``bos`` [B] bool marks the rows whose position 0 (in ``input_pos``) holds the BOS token; there the keys
        and values are ``self.bos_kv``, when set (see :meth:`Transformer.set_bos`). ``span`` is ``(first,
        last)`` of ``input_pos`` as ints, when the caller has them (else read from it).
        """
        B, T, _ = x.shape
        if self.fused is not None and self.fused.runs(x):
            q, k, v = self.fused(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if bos is not None and self.bos_kv is not None:
            k, v = k.clone(), v.clone()
            k[bos, :, 0], v[bos, :, 0] = self.bos_kv[0].to(k.dtype), self.bos_kv[1].to(v.dtype)  # [Hkv, D] each
        if cache is not None:
            # keys before the first one any query may see (past a sliding window) are not read from the cache
            first, last = span or (int(input_pos[0]), int(input_pos[-1]))
            # sym_max: under torch.compile, no guard on which side of the window a position lies (no recompile)
            start = 0 if self.window is None else torch.sym_max(0, first - self.window + 1)
            o = cache.attend(self.layer_idx, q, k, v, input_pos, start, last + 1, mask, self.scale)  # [B, H, T, D]
        else:
            o = attention(q, k, v, mask, self.scale)  # [B, H, T, D]
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        C, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = QLinear(C, F_), QLinear(C, F_), QLinear(F_, C)
        self.fused: FusedLinear | None = None  # gate/up run as one: see fuse_linears
        self.act = config.activation

    def forward(self, x):
        return self.down_proj(self.hidden(x))

    def hidden(self, x):
        """``down_proj``'s input: act(gate_proj(x)) * up_proj(x)."""
        if self.fused is not None and self.fused.runs(x):
            gate, up = self.fused(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none")
        return gate * up


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        arch = config.arch
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = _norm(config)
        self.post_attention_layernorm = _norm(config)
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(config)
            self.post_feedforward_layernorm = _norm(config)
        self.sandwich = arch.sandwich_norms

    def forward(self, x, cos, sin, mask, cache=None, input_pos=None, bos=None, span=None):
        heads = self.self_attn.heads(self.attention_input(x), cos, sin, mask, cache, input_pos, bos, span)
        x = self.after_attention(x, heads)
        return self.after_mlp(x, self.mlp.hidden(self.mlp_input(x)))

    # The forward in stages, each ending at a linear group's input (calibration runs them one at a time):
    # attention_input -> [q/k/v] -> self_attn.heads -> [o] -> after_attention -> mlp_input -> [gate/up]
    # -> mlp.hidden -> [down] -> after_mlp.
    def attention_input(self, x):
        return self.input_layernorm(x)

    def after_attention(self, x, heads):
        """The residual stream after the attention, from its input ``x`` and ``o_proj``'s input ``heads``."""
        h = self.self_attn.o_proj(heads)
        return x + (self.post_attention_layernorm(h) if self.sandwich else h)

    def mlp_input(self, x):
        return self.pre_feedforward_layernorm(x) if self.sandwich else self.post_attention_layernorm(x)

    def after_mlp(self, x, hidden):
        """The block's output, from the residual stream ``x`` and ``down_proj``'s input ``hidden``."""
        h = self.mlp.down_proj(hidden)
        return x + (self.post_feedforward_layernorm(h) if self.sandwich else h)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = QEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = _norm(config)


@dataclass(frozen=True)
class BosState:
    """What a model computes at position 0 for the BOS token: per layer the keys and values ([Hkv, D] each,
    after the key norm and RoPE, as a KV cache holds them), and the final-norm hidden state [C]."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: torch.Tensor


class Transformer(nn.Module):
    """Decoder-only LM. ``forward`` runs T new tokens at consecutive positions ``input_pos`` against the cache."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = QLinear(config.hidden_size, config.vocab_size)
        self.embed_scale = math.sqrt(config.hidden_size) if config.arch.embed_scale else None
        # RoPE tables per distinct RopeConfig (Gemma 3 has two), built on first use per device.
        self._inv_freq: dict[RopeConfig, torch.Tensor] = {}
        self.bos_hidden: torch.Tensor | None = None  # [C]: see set_bos

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.dtype

    @property
    def tied(self) -> bool:
        """Whether the lm_head is the embedding table (``tie_word_embeddings``, unless the checkpoint stores a
        head of its own: see ``qinfer.model.loader``)."""
        return self.lm_head.weight is self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [B, T, C]
        if self.embed_scale is not None:
            # Gemma rounds the scale to the weights' dtype before multiplying.
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def rope(self, layer_idx: int, input_pos: torch.Tensor, dtype: torch.dtype):
        """(cos, signed sin) [T, D] in ``dtype`` for :func:`apply_rope`: the sin's first half negated."""
        return self.rope_tables(self.config.rope[layer_idx], input_pos, dtype)

    def rope_tables(self, rope: RopeConfig, input_pos: torch.Tensor, dtype: torch.dtype):
        """:meth:`rope` of the layers with the RoPE config ``rope``."""
        if rope not in self._inv_freq:
            self._inv_freq[rope] = rope_inv_freq(rope, self.config.head_dim).to(input_pos.device)
        freqs = input_pos.float()[:, None] * self._inv_freq[rope][None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def masks(self, input_pos: torch.Tensor, n_keys: int) -> dict[int | None, torch.Tensor]:
        """Boolean masks [T, S] (True = may attend), one per distinct sliding window."""
        q_pos = input_pos[:, None]
        k_pos = torch.arange(n_keys, device=input_pos.device)[None, :] if n_keys else input_pos[None, :]
        causal = k_pos <= q_pos
        # k_pos > q_pos - w, not q_pos - k_pos < w: the difference would be a [T, S] int64 (8 GiB at 32k tokens)
        return {w: causal if w is None else causal & (k_pos > q_pos - w) for w in set(self.config.sliding_window)}

    def set_bos(self, bos: "BosState | None") -> None:
        """From now on, wherever position 0 holds ``config.bos_token_id``, attend there to ``bos.kv`` instead of
        the keys and values the model's own weights compute, and output ``bos.hidden`` there (None: the model's own).

        A decoder's first position sees only itself, so every sequence that starts with BOS has the same keys,
        values and output there, and later tokens attend to it heavily (Gemma's attention sink, with its massive
        activations). A quantized model keeps the unquantized model's (qinfer.format, "The BOS position"), as
        IntactKV (Liu et al., 2024) keeps their keys and values: the quantization error never reaches the sink.
        """
        if bos is not None and (len(bos.kv) != len(self.model.layers) or self.config.bos_token_id is None):
            raise ValueError(f"set_bos: one (k, v) per layer ({len(self.model.layers)}) of a model with a BOS token")
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.bos_kv = None if bos is None else bos.kv[i]
        self.bos_hidden = None if bos is None else bos.hidden

    def bos_rows(
        self, input_ids: torch.Tensor, input_pos: torch.Tensor, first: int | None = None
    ) -> torch.Tensor | None:
        """[B] bool: the rows whose position 0 holds BOS, where the stored BOS position applies (else None).
        ``first`` is ``input_pos[0]`` as an int, when the caller has it."""
        if self.bos_hidden is None or (int(input_pos[0]) if first is None else first) != 0:
            return None
        rows = input_ids[:, 0] == self.config.bos_token_id
        return rows if bool(rows.any()) else None

    @torch.no_grad()
    def own_bos(self) -> "BosState":
        """What this model's weights compute at position 0 for the BOS token."""
        cache = KVCache(self.config, 1, 1, self.dtype, self.device)
        ids = torch.tensor([[self.config.bos_token_id]], device=self.device)
        hidden = self.hidden_states(ids, torch.arange(1, device=self.device), cache)  # [1, 1, C]
        kv = [cache.read(i, 0, 1)[:2] for i in range(self.config.num_layers)]  # position 0: [1, Hkv, 1, D] each
        return BosState(kv=[(k[0, :, 0].clone(), v[0, :, 0].clone()) for k, v in kv], hidden=hidden[0, 0])

    def hidden_states(self, input_ids, input_pos, cache: KVCache | None = None, span=None) -> torch.Tensor:
        """Final-norm hidden states [B, T, C] of T new tokens (``input_ids`` [B, T], ``input_pos`` [T]).

        ``span``: ``(input_pos[0], input_pos[-1])`` as ints, when the caller has them (a decode step: then
        nothing in the forward reads a tensor back to the host, and a compiled step is one graph)."""
        x = self.embed(input_ids)
        span = span or (int(input_pos[0]), int(input_pos[-1]))  # the positions' range, read once, not per layer
        bos = self.bos_rows(input_ids, input_pos, span[0])
        if x.shape[1] == 1 and bos is None and type(cache) is KVCache and not torch.compiler.is_compiling():
            # a decode step: its layers in one call, where the plan runs them
            h = self._planned_step(x, input_pos, span[0], cache)
            if h is not None:
                return h
        masks = self.masks(input_pos, span[1] + 1 if cache is not None else 0)
        ropes = {}  # cos/sin per distinct RopeConfig (Gemma 3: two), not per layer
        for i, layer in enumerate(self.model.layers):
            rope = self.config.rope[i]
            if rope not in ropes:
                ropes[rope] = self.rope(i, input_pos, x.dtype)
            x = layer(x, *ropes[rope], masks[self.config.sliding_window[i]], cache, input_pos, bos, span)
        h = self.model.norm(x)
        if bos is not None:
            h = h.clone()
            h[bos, 0] = self.bos_hidden.to(h.dtype)
        return h

    def decode_rows(self, input_ids: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
        """Final-norm hidden states [M, C] of M tokens (``input_ids`` [M]), each of its own sequence and position
        as ``rows`` gives them: one decode step of many sequences (see :class:`DecodeRows`). Each row goes through
        the same products as it would alone where the linear kernels sum each row on its own (the C kernels do),
        and attention is per row."""
        x = self.embed(input_ids[:, None])  # [M, 1, C]
        positions = rows.positions
        h = None if torch.compiler.is_compiling() else self._planned_rows(x[:, 0].contiguous(), rows)
        if h is not None:
            return h
        span = (int(positions.min()), int(positions.max()))  # (unused by the rows' attention; read once)
        ropes = {}
        with norm_all_rows():  # every row's norms in one loop, whatever the row count
            for i, layer in enumerate(self.model.layers):
                rope = self.config.rope[i]
                if rope not in ropes:
                    cos, sin = self.rope(i, positions, x.dtype)  # [M, D]: one position per row
                    ropes[rope] = cos[:, None, None], sin[:, None, None]  # [M, 1, 1, D] against [M, H, 1, D]
                x = layer(x, *ropes[rope], None, rows, positions, None, span)
            return self.model.norm(x)[:, 0]

    def _planned_step(self, x: torch.Tensor, input_pos: torch.Tensor, pos: int, cache: KVCache):
        """The final-norm hidden states [B, 1, C] of a decode step of the B bound sequences at position ``pos``
        through the plan's one C call (``qinfer.model.decode_plan``), or None where it does not run them."""
        B, _, C = x.shape
        P, plan = cache.block_size, plan_for(self)
        if plan is None or not FusedLinear.enabled or pos // P >= len(cache.block_rows[0]) or not plan.runs(
                x[:, 0], cache, norm_rows_max()):
            return None  # (separate_linears: a timing of the eager path; past the cache's blocks: the layers say so)
        longs = ctypes.c_int64 * B
        slots, ends = longs(*(row[pos // P] * P + pos % P for row in cache.block_rows)), longs(*[pos + 1] * B)
        starts = [longs(*[0 if w is None else max(0, pos - w + 1)] * B) for w in plan.windows]
        ropes = [self.rope_tables(rope, input_pos, x.dtype) for rope in plan.ropes]  # [1, D] each: every row's
        rows = Rows(B, ctypes.addressof(slots), cache.block_tables.data_ptr(), cache.block_tables.stride(0),
                    ctypes.addressof(ends), [ctypes.addressof(s) for s in starts], [c for c, _ in ropes],
                    [s for _, s in ropes], 0)
        return plan.run(x.reshape(B, C).contiguous(), rows, cache).view(B, 1, C)

    def _planned_rows(self, x: torch.Tensor, rows: DecodeRows) -> torch.Tensor | None:
        """:meth:`decode_rows`' hidden states [M, C] of the embedded ``x`` [M, C] through the plan's one C call,
        or None where it does not run them (its norms take any row count, as the eager rows' do)."""
        plan = plan_for(self)
        if plan is None or not FusedLinear.enabled or type(rows.cache) is not KVCache or not plan.runs(
                x, rows.cache, 1 << 62):
            return None
        ropes = [self.rope_tables(rope, rows.positions, x.dtype) for rope in plan.ropes]  # [M, D] each
        tables = rows.block_tables
        found = Rows(x.shape[0], rows.slots.data_ptr(), tables.data_ptr(), tables.stride(0), rows.ends.data_ptr(),
                     [rows.starts(window).data_ptr() for window in plan.windows], [c for c, _ in ropes],
                     [s for _, s in ropes], self.config.head_dim)
        return plan.run(x, found, rows.cache)

    def forward(self, input_ids, input_pos=None, cache: KVCache | None = None, last_only: bool = False, span=None):
        """Logits [B, T, V] (or [B, 1, V] with ``last_only``) in the model's dtype; ``span`` as in
        :meth:`hidden_states`."""
        if input_pos is None:
            input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.hidden_states(input_ids, input_pos, cache, span)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)


def _norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    arch = config.arch
    return RMSNorm(dim or config.hidden_size, config.rms_norm_eps, arch.norm_offset, arch.norm_scale_in_fp32)
