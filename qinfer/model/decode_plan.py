"""A decode step's layers as one C call: the model's weights and norms, and a KV cache's pages, laid out once as
``qinfer.kernels.decode_cpu`` reads them.

``Transformer.hidden_states`` (a decode step of B sequences at one position: ``qinfer.engine.generate.decode_step``)
and ``Transformer.decode_rows`` (an engine step's rows) hand their rows here when :meth:`DecodePlan.runs` says the
call computes what their layers would: on CPU, eagerly, bf16 activations over a bf16 KV cache, every linear one
the C GEMVs take at this row count, every norm one the C norm takes (``qinfer.kernels.norm_cpu``), the weights
those the plan was built from, and none of the switches that send the eager path to PyTorch's kernels on (the
decoder also asks that fused linears are: ``separate_linears`` times the eager path). Then the call's outputs
are the eager layers' bit for bit (``decode_cpu``): one ctypes call a step in place of a hundred or more PyTorch
and ctypes calls a layer. Anything else runs the layers as modules (as inside :func:`layer_by_layer`).

A plan is built on a model's first decode step (:func:`plan_for`) and kept on it. It holds pointers into the
weights; :meth:`DecodePlan.current` checks each step that every linear, norm and fused group still holds the
object (and a tensor the same data) it was built from, and a model whose weights changed gets a new plan.
"""

import contextlib
import ctypes
import operator
from dataclasses import dataclass

import torch

from qinfer.kernels import cpu_library, decode_cpu, gemv_cpu, norm_cpu
from qinfer.model.kv_cache import KVCache

_P = ctypes.c_void_p


@dataclass
class Rows:
    """One step's rows, as the plan needs them: M rows, each with its KV slot, block table row, position + 1 and,
    per sliding window (the plan's ``windows``), its first visible position. Each field is a pointer (an int)
    to int64 [M] (``table``: [M, tb]) that the caller keeps alive for the call; ``cos`` and ``sin``: per RoPE
    config (the plan's ``ropes``), [M, D] (or [1, D], shared: ``cs`` 0) in the activations' dtype."""

    M: int
    slots: int
    table: int
    tb: int
    ends: int
    starts: list[int]
    cos: list[torch.Tensor]
    sin: list[torch.Tensor]
    cs: int


class DecodePlan:
    """A model's layers as ``decode_cpu`` takes them (see the module docstring)."""

    def __init__(self, model):
        config = model.config
        self.dtype = model.dtype
        self.ropes = list(dict.fromkeys(config.rope))  # distinct RoPE configs, in layer order
        self.windows = list(dict.fromkeys(config.sliding_window))
        one = torch.empty(1, config.hidden_size, dtype=self.dtype)  # a row's shape and dtype, for the checks
        self._keep, self._watch, self._data = [], [], []  # kept alive; (holder, name, object); (tensor, pointer)
        self._kinds: dict[tuple, tuple] = {}  # one weight per (type, K, bits, group): the row checks' sample
        self.ok = (self.dtype == torch.bfloat16 and model.device.type == "cpu" and cpu_library.available()
                   and config.head_dim % 8 == 0 and self._norm_ok(model.model.norm, one))
        layers = []
        for i, block in enumerate(model.model.layers):
            layer = self._layer(block, config.rope[i], one) if self.ok else None
            self.ok = layer is not None
            layers.append(layer)
        self._holders, self._names, self._objects = zip(*self._watch) if self._watch else ((), (), ())
        self._tensors, self._pointers = zip(*self._data) if self._data else ((), ())
        if not self.ok:
            return
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.heads = config.num_heads
        self.table = self._pinned(decode_cpu.activation_table(config.activation, self.dtype))
        self.layers = (decode_cpu.Layer * len(layers))(*layers)
        self.model = decode_cpu.Model(
            config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, cpu_library.DTYPE_CODES[self.dtype], int(config.arch.sandwich_norms),
            self.table.data_ptr(), self._norm(model.model.norm), self.layers)
        self._holders, self._names, self._objects = zip(*self._watch)  # (now with the final norm's weight)
        self._tensors, self._pointers = zip(*self._data)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        self._keep.append(t)
        return t

    def _watched(self, module, name: str):
        """``module.name``, noted so that :meth:`current` sees it replaced (a Parameter, buffer or attribute)."""
        holder = next((d for d in (module._parameters, module._buffers, module._modules, module.__dict__)
                       if name in d), None)
        if holder is None:
            return getattr(module, name)
        self._watch.append((holder, name, holder[name]))
        return holder[name]

    def _norm_ok(self, norm, x: torch.Tensor) -> bool:
        """Whether the C norm takes a row of ``x``'s dtype of ``norm``'s width."""
        w = norm.weight
        return isinstance(w, torch.Tensor) and norm_cpu.rms_norm_supported(x.new_empty(1, w.numel()), w,
                                                                            norm.scale_in_fp32)

    def _norm(self, norm) -> decode_cpu.Norm:
        w = self._watched(norm, "weight")
        self._data.append((w, w.data_ptr()))
        return decode_cpu.norm(w, norm.eps, norm.offset, norm.scale_in_fp32)

    def _linear(self, module, x: torch.Tensor) -> decode_cpu.Linear | None:
        """A QLinear or FusedLinear as the C GEMV takes one row of ``x``'s dtype, or None where it does not."""
        weight, bias = self._watched(module, "weight"), self._watched(module, "bias")
        K = weight.shape[1]
        found = gemv_cpu.prepared(weight, x.new_empty(1, K))
        if found is None:
            return None
        kind, prepared = found
        if isinstance(weight, torch.Tensor):
            self._data.append((weight, weight.data_ptr()))
        self._kinds.setdefault((type(weight), K, getattr(weight, "bits", 0), getattr(weight, "group_size", 0)),
                               (weight, K))
        if bias is not None:
            self._data.append((bias, bias.data_ptr()))
            bias = self._pinned(bias.to(x.dtype).contiguous())
        self._keep.append(prepared)
        return decode_cpu.Linear(ctypes.pointer(prepared), None if bias is None else bias.data_ptr(),
                                 decode_cpu.KINDS[kind])

    def _group(self, owner, names: tuple[str, ...], x: torch.Tensor) -> list | None:
        """The owner's fused linear (one product, then the members' outputs side by side) where it runs, as the
        eager path chooses (``FusedLinear.runs``), and [] for each member; else each member's own."""
        fused = self._watched(owner, "fused")
        if fused is not None and fused.runs(x):
            whole = self._linear(fused, x)
            return None if whole is None else [whole] + [decode_cpu.Linear()] * len(names)
        members = [self._linear(getattr(owner, name), x) for name in names]
        return None if any(m is None for m in members) else [decode_cpu.Linear()] + members

    def _layer(self, block, rope, x: torch.Tensor) -> decode_cpu.Layer | None:
        attn, mlp = block.self_attn, block.mlp
        qkv = self._group(attn, ("q_proj", "k_proj", "v_proj"), x)
        gate_up = self._group(mlp, ("gate_proj", "up_proj"), x)
        o, down = self._linear(attn.o_proj, x), self._linear(mlp.down_proj, x)
        if qkv is None or gate_up is None or o is None or down is None:
            return None
        norms = {"input": block.input_layernorm, "post_attention": block.post_attention_layernorm}
        if block.sandwich:
            norms |= {"pre_feedforward": block.pre_feedforward_layernorm,
                      "post_feedforward": block.post_feedforward_layernorm}
        if hasattr(attn, "q_norm"):
            norms |= {"q": attn.q_norm, "k": attn.k_norm}
        if not all(self._norm_ok(n, x) for n in norms.values()):
            return None
        return decode_cpu.Layer(
            **{name: self._norm(n) for name, n in norms.items()},
            qkv=qkv[0], q_proj=qkv[1], k_proj=qkv[2], v_proj=qkv[3], o_proj=o,
            gate_up=gate_up[0], gate=gate_up[1], up=gate_up[2], down=down,
            rope=self.ropes.index(rope), window=self.windows.index(attn.window), scale=attn.scale)

    def current(self) -> bool:
        """Whether every linear, norm and fused group holds what the plan was built from (the same objects, and
        tensors whose data has not moved)."""
        return all(map(operator.is_, map(dict.get, self._holders, self._names), self._objects)) and all(
            map(operator.eq, map(torch.Tensor.data_ptr, self._tensors), self._pointers))

    def runs(self, x: torch.Tensor, cache: KVCache, norm_rows: int) -> bool:
        """Whether the call computes what the layers would for ``x`` [M, C] over ``cache``'s pages, each C norm
        taking at most ``norm_rows`` rows at a time (the eager path's limit: ``norm_cpu``)."""
        M = x.shape[0]
        return (
            x.dtype == self.dtype and cache.kv_dtype == "bf16" and cache.k[0].dtype == self.dtype
            and M * (self.heads if self.qk_norm else 1) <= norm_rows  # (q's norm: a row per head)
            and cpu_library.row_loop_allowed(x) and self.current()
            and (M == 1 or all(gemv_cpu.prepared(w, x.new_empty(M, K)) for w, K in self._kinds.values()))
        )

    def run(self, x: torch.Tensor, rows: Rows, cache: KVCache) -> torch.Tensor:
        """``x`` [M, C] (the embedded tokens; overwritten) through every layer, writing each row's key and value
        into ``cache``'s pages: the final norm of the residual stream, [M, C]."""
        out = torch.empty_like(x)
        cos = (_P * len(rows.cos))(*(t.data_ptr() for t in rows.cos))
        sin = (_P * len(rows.sin))(*(t.data_ptr() for t in rows.sin))
        starts = (_P * len(rows.starts))(*rows.starts)
        k_pages = (_P * len(cache.k))(*(t.data_ptr() for t in cache.k))
        v_pages = (_P * len(cache.v))(*(t.data_ptr() for t in cache.v))
        step = decode_cpu.Step(rows.M, x.data_ptr(), out.data_ptr(), rows.slots, rows.table, rows.tb,
                               cache.block_size, rows.ends, starts, cos, sin, rows.cs, k_pages, v_pages)
        decode_cpu.decode_layers(self.model, step)
        return out


_ENABLED = [True]


@contextlib.contextmanager
def layer_by_layer():
    """Inside it, decode steps run their layers as modules (the eager path the plan's call is checked against,
    or a side-by-side timing)."""
    before, _ENABLED[0] = _ENABLED[0], False
    try:
        yield
    finally:
        _ENABLED[0] = before


def plan_for(model) -> DecodePlan | None:
    """The model's plan, built on first use and again when its weights changed; None where the C call cannot
    run its layers (then it never will for these weights), and inside :func:`layer_by_layer`."""
    if not _ENABLED[0]:
        return None
    plan = model.__dict__.get("_decode_plan")
    if plan is None or not plan.current():
        plan = DecodePlan(model)
        model.__dict__["_decode_plan"] = plan
    return plan if plan.ok else None
