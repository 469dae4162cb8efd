"""Block-by-block activation capture for calibration.

The calibration batch enters as embeddings; each decoder block is run on its own, with hooks on its
linears that accumulate what the quantizers need. Only one block's activations are alive at a time:
``X`` [S, L, C] (S samples of L tokens) goes in, the block's output comes out and replaces it.

Per linear input (linears that share an input, like q/k/v, share one record):
- the Hessian proxy ``H = sum_t x_t x_t^T`` [K, K] (GPTQ), summed in fp32 over batches whose products are
  computed in the activations' dtype (bf16 matmuls are faster than fp32 ones on a CPU that multiplies bf16
  natively, see below; a batch's bf16-rounded partial sum is within ~0.2% of fp32 per entry, well below GPTQ's
  1% damping),
- the mean absolute activation per input channel [K] (AWQ's salience; AWQ's searches use H too).
- with a second stream ``X_ref`` (the unquantized model's activations, for GPTQ's ``--fp-target``): the
  input-shift matrix ``D = sum_t (x~_t - x_t) x_t^T`` [K, K] in fp32, x~ the input the unquantized block
  sees on the same token; each batch runs through the block twice, once per stream.
Per attention layer: the absolute maximum of the keys (after norm and RoPE, as the cache stores them) and
values per KV head and channel, for KV-cache quantization scales.

A model with a stored BOS position (``Transformer.set_bos``; the pipeline sets one only when every calibration
sample starts with BOS) attends to the stored keys and values there and outputs the stored hidden state, so
nothing the quantized weights compute at that position is ever seen: its rows are left out of every statistic
above but the K/V ranges (:func:`first_kept`). In Gemma 3 they are the attention sink's, whose residual stream
is several times any other token's.

The blocks run in :func:`compute_dtype`: bf16 where the device multiplies bf16 natively (a GPU, or a CPU
with AVX-512 or AMX, where oneDNN runs bf16 matmuls), else fp32. On an AVX2-only CPU torch's bf16 matmul
is a generic fallback several times slower than its fp32 one (``qinfer roofline`` times both; figures in
docs/results.md, "Speed against the roofline"), so calibration there runs each block in fp32
(:func:`block_in`), one block at a time.
"""

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qinfer.kernels.attention import attention
from qinfer.kernels.dense import native_half_gemm
from qinfer.model.decoder import Block, QLinear, RMSNorm, Transformer


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype calibration runs blocks in on ``device``: bf16 where it has fast bf16 matmuls, else fp32."""
    if device.type == "cpu" and not native_half_gemm(torch.bfloat16):
        return torch.float32
    return torch.bfloat16


@contextlib.contextmanager
def block_in(block: torch.nn.Module, dtype: torch.dtype, back: torch.dtype) -> Iterator[None]:
    """Hold ``block`` in ``dtype`` inside the ``with``, then cast it to ``back``. Norm weights follow
    ``RMSNorm.weight_dtype``: a norm that scales in fp32 (Gemma) keeps an fp32 weight, e.g. one AWQ folded."""
    _cast(block, dtype)
    try:
        yield
    finally:
        _cast(block, back)


def _cast(block: torch.nn.Module, dtype: torch.dtype) -> None:
    norms = {m: m.weight.data for m in block.modules() if isinstance(m, RMSNorm)}
    block.to(dtype)
    for m, w in norms.items():
        m.weight.data = w.to(m.weight_dtype(dtype, w.dtype))


@dataclass
class LinearStats:
    H: torch.Tensor  # [K, K] fp32, sum of x x^T
    abs_sum: torch.Tensor  # [K] fp32, sum of |x|
    n: int = 0  # rows seen
    D: torch.Tensor | None = None  # [K, K] fp32, sum of (x_ref - x) x^T, when a reference stream was given

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.n, 1)


@dataclass
class BlockStats:
    linears: dict[str, LinearStats]
    k_absmax: torch.Tensor  # [Hkv, D]: per KV head and channel
    v_absmax: torch.Tensor  # [Hkv, D]


class _StatsCache:
    """Stands in for the KV cache during calibration: records the absmax per KV head and channel, stores nothing."""

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.k_absmax = torch.zeros(n_kv_heads, head_dim)
        self.v_absmax = torch.zeros(n_kv_heads, head_dim)

    def attend(self, layer, q, k, v, input_pos, start, end, mask, scale):
        # k, v: [B, Hkv, T, D], a whole sample's (input_pos 0..T-1): q attends over positions start.., as over a
        # bf16 KV cache
        self.k_absmax = torch.maximum(self.k_absmax, k.detach().abs().amax(dim=(0, 2)).float().cpu())
        self.v_absmax = torch.maximum(self.v_absmax, v.detach().abs().amax(dim=(0, 2)).float().cpu())
        return attention(q, k[:, :, start:], v[:, :, start:], None if q.shape[2] == 1 else mask[:, start:], scale)


def embed_samples(model: Transformer, samples: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block 0's input for the calibration batch: ``samples`` [S, L] token ids -> [S, L, C]."""
    with torch.no_grad():
        return torch.cat([model.embed(s[None].to(model.device)) for s in samples]).to(dtype)


BATCH_BYTES = 16 << 20  # bound on one batch's widest activation, e.g. the MLP's [B, L, F] intermediates


def batch_size(model: Transformer, X: torch.Tensor) -> int:
    """Samples per block forward for X [S, L, C]: as many as keep the widest per-batch activation within
    ``BATCH_BYTES`` (8 for Gemma 3 270M's 512-token bf16 samples, 4 in fp32). glibc hands out blocks up to
    32 MiB from memory it reuses but maps bigger ones fresh and page-faults them in on every batch, a cost
    paid again each batch (measured: docs/results.md, "Figures formerly in code comments")."""
    c = model.config
    width = max(c.intermediate_size, c.hidden_size, c.num_heads * c.head_dim)
    return max(1, BATCH_BYTES // (X.shape[1] * width * X.element_size()))


def first_kept(model: Transformer) -> int:
    """The first position of a calibration sample that counts in the statistics: 1 where the model has a stored
    BOS position (every sample starts with BOS then), else 0."""
    return int(model.bos_hidden is not None)


def bos_rows(model: Transformer, x: torch.Tensor) -> torch.Tensor | None:
    """The ``bos`` argument of a block's forward for a batch ``x`` [B, L, C] of calibration samples."""
    return torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if first_kept(model) else None


@torch.no_grad()
def run_block(
    model: Transformer,
    layer_idx: int,
    X: torch.Tensor,
    batch: int | None = None,
    cache=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block's output for every sample: X [S, L, C] -> [S, L, C], computed in X's dtype (the block's
    weights must be in that dtype too: calibration runs one block in fp32 inside a bf16 model).

    ``out=X`` writes the output over the input, batch by batch (a sample's output depends on that sample
    alone), so the pipeline holds one [S, L, C] buffer per stream rather than two.
    """
    block: Block = model.model.layers[layer_idx]
    L = X.shape[1]
    pos = torch.arange(L, device=model.device)
    mask = model.masks(pos, L if cache is not None else 0)[model.config.sliding_window[layer_idx]]
    out = torch.empty_like(X) if out is None else out
    batch = batch or batch_size(model, X)
    for i in range(0, X.shape[0], batch):
        x = X[i : i + batch].to(model.device)
        cos, sin = model.rope(layer_idx, pos, x.dtype)
        out[i : i + batch] = block(x, cos, sin, mask, cache, pos, bos_rows(model, x))
    return out


@contextlib.contextmanager
def _holding(block: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The named linears of ``block`` hold ``weights`` inside the ``with``, their own weights after."""
    own = {name: block.get_submodule(name).weight.data for name in weights}
    try:
        for name, w in weights.items():
            block.get_submodule(name).weight.data = w
        yield
    finally:
        for name, w in own.items():
            block.get_submodule(name).weight.data = w


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse: blocks up to 32 MiB come from its heap rather than
    fresh mappings, and the heap is not trimmed back to the OS between batches. Calibration frees and
    re-allocates the same activation sizes every batch; without this the pages are faulted in again each
    time, in system time (default GPTQ on Gemma 3 270M in fp32, with and without it: docs/results.md,
    "Figures formerly in code comments").
    Process-wide; False (and nothing changed) where malloc is not glibc's."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(mallopt(M_MMAP_THRESHOLD, 32 << 20))


def return_freed_memory() -> bool:
    """Give the free memory inside malloc's heaps back to the OS (glibc's ``malloc_trim``): with freed blocks
    kept for reuse (:func:`reuse_freed_memory`), the holes that allocations of a finished block leave would
    otherwise stay resident. Cheap once per block. False (and nothing done) where malloc is not glibc's."""
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def _glibc(function: str):
    """glibc's ``function`` through ctypes, or None where the C library is not glibc."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), function)
    except (OSError, AttributeError):
        return None


_GRAM_STRIP = 256  # rows of H per product in _add_upper_gram


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, the product in ``a``'s and ``b``'s dtype (bf16 activations: a bf16 GEMM, fp32 inside),
    summed into the fp32 ``acc`` (a view is updated in place)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += (a @ b).float()


def _add_upper_gram(H: torch.Tensor, x: torch.Tensor) -> None:
    """``H += x^T x`` on and above the diagonal, strip by strip of ``_GRAM_STRIP`` rows (below it, only inside
    the diagonal blocks): about half the multiply-adds of the full product, which is symmetric anyway. The
    full ``H`` is ``H.triu() + H.triu(1).T`` (:func:`_symmetric`). x: [rows, K]; H: [K, K] fp32."""
    for a in range(0, x.shape[1], _GRAM_STRIP):
        b = a + _GRAM_STRIP
        _add_product(H[a:b, a:], x[:, a:b].T, x[:, a:])


def _new_stats(K: int, shifts: bool) -> LinearStats:
    return LinearStats(H=torch.zeros(K, K), abs_sum=torch.zeros(K), D=torch.zeros(K, K) if shifts else None)


def _add_input(s: LinearStats, x: torch.Tensor) -> None:
    """Add one batch of a linear's inputs ``x`` [rows, K] (on the CPU) to its statistics (H upper triangle)."""
    _add_upper_gram(s.H, x)
    s.abs_sum += x.abs().float().sum(0)
    s.n += x.shape[0]


def _add_shift(s: LinearStats, x_ref: torch.Tensor, x: torch.Tensor) -> None:
    """``D += (x_ref - x)^T x`` for one batch: the reference stream's inputs against the quantized one's. As the
    Gram's, the product is in the activations' dtype, summed into D in fp32 (a bf16 product is faster than an
    fp32 one where the CPU multiplies bf16 natively; docs/results.md, "Figures formerly in code comments")."""
    _add_product(s.D, (x_ref.to(x.dtype) - x).T, x)


def _symmetric(H: torch.Tensor) -> torch.Tensor:
    return H.triu() + H.triu(1).T


class _EnoughSeen(Exception):
    """Raised by the last hooked linear of a partial capture: the rest of the block is not needed."""


@torch.no_grad()
def capture_block(
    model: Transformer,
    layer_idx: int,
    X: torch.Tensor,
    groups: tuple[tuple[str, ...], ...],
    partial: bool = False,
) -> BlockStats:
    """Run block ``layer_idx`` on X [S, L, C] and collect statistics for its linears.

    ``groups`` lists linears that read the same input; each group is hooked once and its members share
    one ``LinearStats``. With ``partial``, the block's forward stops once the last group (in forward order)
    has seen its input; the K/V ranges are then those of whatever attention ran (zero if none did).
    """
    block = model.model.layers[layer_idx]
    modules: dict[str, QLinear] = {group[0]: block.get_submodule(group[0]) for group in groups}
    stats = {name: _new_stats(m.in_features, False) for name, m in modules.items()}
    last = groups[-1][0] if partial and groups else None
    first = first_kept(model)

    def hook(name):
        def fn(module, inputs):
            x = inputs[0].detach()[:, first:]  # [B, L - first, K]
            _add_input(stats[name], x.reshape(-1, x.shape[-1]).cpu())  # [rows, K]
            if name == last:
                raise _EnoughSeen

        return fn

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    cache = _StatsCache(model.config.num_kv_heads, model.config.head_dim)
    try:
        if last is None:
            run_block(model, layer_idx, X, cache=cache)
        else:
            batch = batch_size(model, X)
            for i in range(0, X.shape[0], batch):
                try:
                    run_block(model, layer_idx, X[i : i + batch], cache=cache)
                except _EnoughSeen:
                    pass
    finally:
        for h in handles:
            h.remove()
    for s in stats.values():
        s.H = _symmetric(s.H)
    shared = {name: stats[group[0]] for group in groups for name in group}
    return BlockStats(linears=shared, k_absmax=cache.k_absmax, v_absmax=cache.v_absmax)


KEEP_DTYPE = torch.bfloat16  # the kept o_proj / down_proj inputs of a staged pass (the model's own activation dtype)


@torch.no_grad()
def calibrate_in_stages(
    model: Transformer,
    layer_idx: int,
    X: torch.Tensor,
    quantize: Callable[[int, dict[str, LinearStats]], None],
    X_ref: torch.Tensor | None = None,
    ref_weights: dict[str, torch.Tensor] | None = None,
) -> BlockStats:
    """Calibrate block ``layer_idx`` one linear group at a time ("true sequential"), in one pass per stream.

    The block runs in its stages (:class:`qinfer.model.decoder.Block`), each ending at a linear group's input, in
    forward order (q/k/v, o, gate/up, down). After a stage has run on every sample, ``quantize(g, stats)``
    is called with group ``g``'s statistics and replaces that group's weights, so the next stage computes
    its inputs with the groups before it already quantized. Nothing is computed twice: the residual stream
    is advanced in ``X`` itself and the o_proj and down_proj inputs, which a later stage consumes once the
    group reading them is quantized, are kept in one [S, L, max width] buffer in ``KEEP_DTYPE``.
    ``X`` (and ``X_ref``) end as the block's output, written in place.

    With ``X_ref`` (the unquantized model's stream, with ``ref_weights`` its linears' unquantized weights)
    each batch also runs there, stage by stage, and each group's input shift ``D = sum (x_ref - x)^T x`` is
    collected beside its ``H``. The K/V ranges are the quantized stream's, with q/k/v already quantized: what
    the cache will hold.
    """
    if X_ref is not None and X_ref.shape != X.shape:
        raise ValueError(f"the reference stream's shape {list(X_ref.shape)} is not X's {list(X.shape)}")
    block: Block = model.model.layers[layer_idx]
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    S, L, _ = X.shape
    pos = torch.arange(L, device=model.device)
    mask = model.masks(pos, 0)[model.config.sliding_window[layer_idx]]
    heads_width = block.self_attn.o_proj.in_features
    # zeros, not empty: o_proj reads kept[..., :heads_width], a view with wider rows, and PyTorch's bf16 GEMM
    # may read a row's unused tail (times zero): memory that happened to hold a NaN made the output NaN
    kept = torch.zeros(S, L, max(heads_width, block.mlp.down_proj.in_features), dtype=KEEP_DTYPE, device=X.device)
    cache = _StatsCache(model.config.num_kv_heads, model.config.head_dim)
    batch = batch_size(model, X)
    first = first_kept(model)

    def stage(g: int, x: torch.Tensor, rows: slice | None, kv=None) -> torch.Tensor:
        """Group g's input for the batch x (the residual stream at the block's stage g). ``rows`` (the
        quantized stream): advance ``X`` and ``kept`` lazily; None (the reference): advance ``X_ref`` now."""
        if g == 0:
            return block.attention_input(x)
        if g == 1:
            cos, sin = model.rope(layer_idx, pos, x.dtype)
            heads = block.self_attn.heads(block.attention_input(x), cos, sin, mask, kv, pos, bos_rows(model, x))
            if rows is not None:
                kept[rows, :, :heads_width] = heads
            return heads
        if g == 2:
            if rows is not None:  # o_proj is quantized now
                x = block.after_attention(x, kept[rows, :, :heads_width].to(x.dtype))
                X[rows] = x
            return block.mlp_input(x)
        hidden = block.mlp.hidden(block.mlp_input(x))
        if rows is not None:
            kept[rows, :, : hidden.shape[-1]] = hidden
        return hidden

    all_stats: dict[str, LinearStats] = {}
    for g, group in enumerate(groups):
        s = _new_stats(block.get_submodule(group[0]).in_features, X_ref is not None)
        for i in range(0, S, batch):
            rows = slice(i, i + batch)
            x = stage(g, X[rows].to(model.device), rows, cache)
            x = x[:, first:].reshape(-1, x.shape[-1]).cpu()
            _add_input(s, x)
            if X_ref is not None:
                with _holding(block, ref_weights or {}):
                    x_ref = X_ref[rows].to(model.device)
                    inp = stage(g, x_ref, None)
                    if g == 1:
                        X_ref[rows] = block.after_attention(x_ref, inp)
                    elif g == 3:
                        X_ref[rows] = block.after_mlp(x_ref, inp)
                _add_shift(s, inp[:, first:].reshape(-1, inp.shape[-1]).cpu(), x)
        s.H = _symmetric(s.H)
        stats = {name: s for name in group}
        all_stats.update(stats)
        quantize(g, stats)
    down_width = block.mlp.down_proj.in_features
    for i in range(0, S, batch):  # down_proj is quantized now: the block's output
        rows = slice(i, i + batch)
        x = X[rows].to(model.device)
        X[rows] = block.after_mlp(x, kept[rows, :, :down_width].to(x.dtype))
    return BlockStats(linears=all_stats, k_absmax=cache.k_absmax, v_absmax=cache.v_absmax)
