"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration"):
protect the weights that meet large activations by scaling input channels before round-to-nearest.

For a linear ``y = x W^T`` and any positive per-input-channel ``s [K]``, ``x W^T = (x / s) (W s)^T`` exactly.
Quantizing ``W s`` instead of ``W`` multiplies a salient column (one whose input channel carries large
activations) by ``s_k > 1`` before rounding, so its relative rounding error shrinks, while the ``1 / s``
moves into whatever produces ``x`` (a norm's weight, a preceding linear's rows) at no runtime cost.

Scale search (:func:`awq_search_scales`), in float32:

- ``x_mean[k] = mean_t |X[t, k]|`` over the calibration tokens.
- For ``ratio`` in ``{0, 1/n, ..., (n-1)/n}``: ``s = clamp(x_mean^ratio, min=1e-4)``, normalised to
  ``s / sqrt(max(s) min(s))`` so it straddles 1. The candidate weights are ``Q(W_i s) / s`` for every
  linear ``W_i [N_i, K]`` that reads ``X`` (RTN with the caller's scheme), and the candidate's error is
  each linear's relative output error averaged over all the linears' rows,
  ``sum_i N_i ||X (W_i - Q(W_i s) / s)^T||^2 / ||X W_i^T||^2 / sum_i N_i``, or the mean squared
  difference of ``forward(candidate weights)`` from ``forward(original weights)`` when the caller passes
  the block's forward. The smallest error wins; ties go to the smaller ratio.
- Relative, not absolute: the linears that share an input meet after it in products (``q . k`` through the
  softmax, Gemma's q/k norms making the size of ``q`` and ``k`` irrelevant; ``act(gate) * up``), where what
  counts is each factor's error against its own size. Summed absolutely, the linear with the largest outputs
  would pick the scales for all of them. For one linear the two rank the candidates alike.
- This is the paper's scale ``x_mean^ratio``, not AutoAWQ's default "duo scaling"
  ``x_mean^ratio / w_mean^(1 - ratio)`` (``w_mean`` being the mean group-normalised ``|W|`` per column).
  Reason: at ``ratio = 0`` the paper's grid gives ``s = 1`` exactly, i.e. plain RTN, so the searched
  result is never worse than RTN on the calibration objective; duo scaling's ``ratio = 0`` point is
  ``1 / w_mean``, which has no such guarantee. :func:`awq_search_scales` takes ``duo_scaling=True`` to
  get AutoAWQ's grid when comparing against its checkpoints.
- A candidate whose ``W s`` would need a group scale past float16's range cannot be stored and gets the
  error ``inf`` (only possible for extreme activation spreads; ``ratio = 0`` is always storable).

Clip search (:func:`awq_search_clip`), applied to the already scaled weights ``W s`` with inputs ``X / s``:
every group's range is narrowed before rounding, trading a clamped outlier for a finer grid, and each group
keeps the narrowing whose group output error ``mean_t (X_g (W_g - Q_g)^T)^2`` is smallest (on a token
subsample, or on all tokens through the Gram matrix in :func:`awq_search_clip_gram`). Symmetric schemes use
AutoAWQ's grid: clamp the group to ``[-m, m]`` with ``m = absmax * (1 - i / n)`` for ``i = 0 .. max_shrink * n``
(``1.0`` down to ``1 - max_shrink`` inclusive; AutoAWQ stops one step short of the last). Asymmetric schemes
narrow each end on its own: ``[lo (1 - i / n), hi (1 - j / n)]`` over the same steps for ``i`` and ``j``
(``lo = min(W_g, 0)``, ``hi = max(W_g, 0)``), since their grid spans ``[lo, hi]`` and a symmetric clamp can
only trim whichever side reaches past it (AutoAWQ's choice for both kinds of grid). Step 0 (both ends) is a
no-op clamp, so no group's error exceeds its unclipped error. The result is the clamp range ``(lo, hi)``
per group; rounding the clamped group to nearest gives the grid that spans it.

A group's own output error is only part of its row's: the row's error over the tokens is ``D H D^T``
(``D`` the row's rounding error, ``H = X^T X``), whose cross terms ``D_g H_gh D_h^T`` couple the groups
wherever the input channels correlate (normed activations share large common components). So
:func:`awq_search_clip_gram` then sweeps the groups (``sweeps`` times, 2 by default): each group in turn
re-picks its pair from the same grid for the whole row's error, the other groups' errors held as they
stand, which can only lower each row's error (a coordinate descent started from the per-group picks). The
rounding stays round-to-nearest on each group's grid; only which range each group takes changes.

The search results (scales, ratio, error curve, clip values) are data. Applying them is separate:
:func:`fold_scales_into_norm` / :func:`fold_scales_into_linear` divide the producer of ``X`` by ``s``
(:func:`fold_scales_into_quantized` when that producer is already quantized), :func:`scale_linear_inputs`
multiplies each consumer's columns by ``s``, and :func:`apply_clip` clamps to the chosen range
before the final quantization. Which norm or linear feeds which is the architecture table's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, QuantScheme, check_int_shape, dequantize_codes
from qinfer.quantizers.rtn import ACTIVATIONS_OVERFLOW, FP16_MAX, LEAST_SCALE, check_finite, quantize_codes, rtn_params

FP16_MIN_NORMAL = 2.0**-14
MIN_SCALE = 1e-4  # floor for x_mean^ratio: dead channels (x_mean = 0) must not produce a zero or infinite 1/s
_CHUNK = 1 << 24  # elements of one [groups, tokens, rows] error block in the clip search (64 MiB in fp32)


@dataclass(frozen=True)
class AwqScaleResult:
    """The chosen per-input-channel scales and the whole search curve.

    ``scales`` is float32 ``[K]``, positive and finite: divide the input by it (fold into the producer),
    multiply the weights' columns by it. ``errors[i]`` is the error of ``ratios[i]`` (``inf`` where the
    scaled weights do not fit a float16 scale); ``ratio == ratios[argmin(errors)]``.
    """

    scales: torch.Tensor
    ratio: float
    ratios: tuple[float, ...]
    errors: tuple[float, ...]

    @property
    def error(self) -> float:
        """The error of the chosen scales."""
        return min(self.errors)


def fake_quantize(W: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN quantize-dequantize of ``W [N, K]`` in float32: exactly what ``rtn_quantize(W).dequantize`` gives."""
    scale, zero = rtn_params(W, scheme.bits, scheme.group_size, scheme.symmetric)
    codes = quantize_codes(W, scale, zero, scheme.bits, scheme.group_size)
    return dequantize_codes(codes, scale, zero, scheme.group_size)


def _check_int_scheme(scheme: QuantScheme) -> None:
    if scheme.format != "int":
        raise QinferError(f"AWQ needs an integer scheme, got format {scheme.format!r}; use method 'fp8' for FP8")


def _check_inputs(X: torch.Tensor, weights: Sequence[torch.Tensor], scheme: QuantScheme) -> None:
    _check_int_scheme(scheme)
    if X.dim() != 2:
        raise QinferError(f"AWQ: calibration inputs must be 2-D [tokens, K], got shape {list(X.shape)}")
    if X.shape[0] == 0:
        raise QinferError("AWQ: calibration inputs have no tokens; capture at least one calibration sample")
    if not weights:
        raise QinferError("AWQ: no weights given; pass the linears that read these inputs")
    check_finite(X, "AWQ: calibration inputs")
    _check_weights(weights, X.shape[1], "the inputs'", scheme)
    for i, W in enumerate(weights):
        check_finite(W, f"AWQ weights[{i}]: weight")


def _label(names: Sequence[str] | None) -> str:
    """How errors name the linears being searched: ``model.layers.1.mlp.gate_proj/up_proj``, or "AWQ" unnamed."""
    if not names:
        return "AWQ"
    head, _, _ = names[0].rpartition(".")
    rest = [n.removeprefix(f"{head}.") for n in names[1:]]
    return "/".join([names[0], *rest])


def _check_gram(gram: torch.Tensor, weights: Sequence[torch.Tensor], scheme: QuantScheme, label: str = "AWQ") -> None:
    """The Gram-matrix searches' twin of :func:`_check_inputs`: ``gram [K, K]`` and weights ``[N, K]`` that fit
    the scheme's integer layout."""
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise QinferError(f"AWQ: the Gram matrix must be square [K, K], got shape {list(gram.shape)}")
    check_finite(gram, f"{label}: Gram matrix", ACTIVATIONS_OVERFLOW)
    _check_weights(weights, gram.shape[0], "the Gram matrix's", scheme)


def _check_weights(weights: Sequence[torch.Tensor], K: int, source: str, scheme: QuantScheme) -> None:
    """Weights ``[N, K]`` that fit the scheme's integer layout and read the ``K`` channels of ``source``."""
    for i, W in enumerate(weights):
        name = f"AWQ weights[{i}]"
        check_int_shape(tuple(W.shape), scheme.bits, scheme.group_size, name)
        if W.shape[1] != K:
            raise QinferError(f"{name}: in_features {W.shape[1]} != {source} K={K}; pass the linears that read X")


def _check_grid(n_grid: int) -> None:
    if type(n_grid) is not int or n_grid < 1:
        raise QinferError(f"AWQ: n_grid must be a positive int, got {n_grid!r}")


def _group_normalised_abs_mean(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """``w_mean [K]``: mean over all rows of ``|W|`` divided by its group's absmax (AutoAWQ's duo scaling)."""
    W = torch.cat([w.float() for w in weights], dim=0).abs()
    N, K = W.shape
    G = K if group_size == -1 else group_size
    g = W.reshape(N, K // G, G)
    return (g / (g.amax(dim=-1, keepdim=True) + 1e-6)).reshape(N, K).mean(dim=0)


def _candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    if w_mean is None:
        s = x_mean.pow(ratio).clamp(min=MIN_SCALE)
    else:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + MIN_SCALE)).clamp(min=MIN_SCALE)
    return s / (s.max() * s.min()).sqrt()


def _storable(W: torch.Tensor, scheme: QuantScheme) -> bool:
    # Both grids have scale <= 2 * absmax / maxq (asymmetric: (hi - lo) / maxq with lo <= 0 <= hi).
    return 2.0 * float(W.abs().max()) / scheme.maxq <= FP16_MAX


def awq_search_scales(
    X: torch.Tensor,
    weights: Sequence[torch.Tensor],
    scheme: QuantScheme,
    forward: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    n_grid: int = 20,
    *,
    duo_scaling: bool = False,
) -> AwqScaleResult:
    """Search per-input-channel scales ``s [K]`` for the linears ``weights`` (each ``[N_i, K]``) reading ``X [T, K]``.

    ``forward``, when given, maps a list of float32 weights (same order and shapes as ``weights``) to the
    output of the block they belong to on the calibration inputs; it is called once with the original
    weights and once per candidate with ``Q(W_i s) / s``, which is what the block computes once ``1 / s``
    is folded into its input. See the module docstring for the grid and the default error.
    """
    _check_inputs(X, weights, scheme)
    _check_grid(n_grid)
    Xf = X.float()
    Ws = [w.float() for w in weights]
    x_mean = Xf.abs().mean(dim=0)
    w_mean = _group_normalised_abs_mean(Ws, scheme.group_size) if duo_scaling else None

    if forward is None:

        def out_sq(D: torch.Tensor) -> float:  # ||X D^T||^2
            return float((Xf @ D.T).pow(2).sum())

        weight = _relative_weights([out_sq(w) for w in Ws], Ws)

        def error(candidate: list[torch.Tensor]) -> float:
            return sum(r * out_sq(w - c) for r, w, c in zip(weight, Ws, candidate))

    else:
        reference = forward(Ws).float()
        check_finite(reference, "AWQ: forward(original weights)")

        def error(candidate: list[torch.Tensor]) -> float:
            out = forward(candidate).float()
            if out.shape != reference.shape:
                raise QinferError(f"AWQ: forward returned shape {list(out.shape)}, expected {list(reference.shape)}")
            check_finite(out, "AWQ: forward(candidate weights)")
            return float((out - reference).pow(2).mean())

    return _search_scales(x_mean, w_mean, Ws, scheme, error, n_grid)


def awq_search_scales_gram(
    x_mean: torch.Tensor,
    gram: torch.Tensor,
    weights: Sequence[torch.Tensor],
    scheme: QuantScheme,
    n_grid: int = 20,
    *,
    duo_scaling: bool = False,
    names: Sequence[str] | None = None,
) -> AwqScaleResult:
    """:func:`awq_search_scales` with the default error computed from statistics instead of activations.

    ``x_mean [K]`` is mean |x| per channel and ``gram [K, K]`` is ``X^T X`` over all calibration tokens
    (what GPTQ calls H). ``||X D^T||^2 = tr(D X^T X D^T)``, so each candidate costs ``N K^2`` instead of
    ``T K N`` and sees every calibration token, not a subsample. The errors are those of
    :func:`awq_search_scales` on the full X (relative errors, so ``gram``'s scale, e.g. a division by the
    token count, does not change them). ``names``, the linears' names in ``weights``' order, label errors.
    """
    _check_int_scheme(scheme)
    _check_grid(n_grid)
    label = _label(names)
    _check_gram(gram, weights, scheme, label)
    check_finite(x_mean, f"{label}: activation means", ACTIVATIONS_OVERFLOW)
    Ws = [w.float() for w in weights]
    H = gram.float()
    w_mean = _group_normalised_abs_mean(Ws, scheme.group_size) if duo_scaling else None

    def out_sq(D: torch.Tensor) -> float:  # ||X D^T||^2 = tr(D H D^T)
        return float((D @ H * D).sum())

    weight = _relative_weights([out_sq(w) for w in Ws], Ws)

    def error(candidate: list[torch.Tensor]) -> float:
        return sum(r * out_sq(w - c) for r, w, c in zip(weight, Ws, candidate))

    return _search_scales(x_mean.float(), w_mean, Ws, scheme, error, n_grid, names)


def _relative_weights(energies: Sequence[float], Ws: Sequence[torch.Tensor]) -> list[float]:
    """What each linear's squared output error is multiplied by in the scale search's error: ``N_i`` over its
    output energy ``||X W_i^T||^2`` and the group's rows ``sum_i N_i`` (see the module docstring). A linear whose
    outputs are all zero (all-zero weights, or dead inputs) quantizes exactly at every scale and weighs 0."""
    rows = sum(w.shape[0] for w in Ws)
    return [w.shape[0] / (e * rows) if e > 0 else 0.0 for e, w in zip(energies, Ws)]


def _search_scales(x_mean, w_mean, Ws, scheme, error, n_grid, names=None) -> AwqScaleResult:
    ratios = tuple(i / n_grid for i in range(n_grid))
    errors: list[float] = []
    best, best_err = None, math.inf
    for ratio in ratios:
        s = _candidate_scales(x_mean, w_mean, ratio)
        scaled = [w * s for w in Ws]
        if not all(_storable(w, scheme) for w in scaled):
            errors.append(math.inf)
            continue
        err = error([fake_quantize(w, scheme) / s for w in scaled])
        errors.append(err)
        if err < best_err:
            best, best_err = (s, ratio), err
    if best is None:
        too_large = [n for n, w in zip(names or (), Ws) if not _storable(w, scheme)]
        raise QinferError(f"{too_large[0] if too_large else _label(names)}: weights too large for a float16 scale "
                          "at every AWQ ratio; weights this large are no trained model's; check the checkpoint")
    return AwqScaleResult(scales=best[0], ratio=best[1], ratios=ratios, errors=tuple(errors))


def _groups_of(W: torch.Tensor, group_size: int) -> tuple[int, int]:
    K = W.shape[1]
    G = K if group_size == -1 else group_size
    return G, K // G


def apply_clip(W: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Clamp each group of ``W [N, K]`` to ``[lo, hi]``, both ``[N, K/G]`` with ``lo <= 0 <= hi``; keeps W's dtype."""
    for name, t in (("lo", lo), ("hi", hi)):
        if W.dim() != 2 or t.dim() != 2 or t.shape[0] != W.shape[0] or not t.shape[1] or W.shape[1] % t.shape[1]:
            raise QinferError(
                f"apply_clip: {name} {list(t.shape)} does not give whole groups of W {list(W.shape)}; "
                "pass the [N, K/G] range awq_search_clip returned for this weight"
            )
        check_finite(t, f"apply_clip: {name}")
    if lo.shape != hi.shape:
        raise QinferError(f"apply_clip: lo {list(lo.shape)} and hi {list(hi.shape)} differ in shape")
    if bool((lo > 0).any()) or bool((hi < 0).any()):
        raise QinferError("apply_clip: the range must contain 0 (lo <= 0 <= hi); pass awq_search_clip's result")
    N, K = W.shape
    G = K // lo.shape[1]
    shape = (N, K // G, 1)
    clamped = torch.minimum(W.float().reshape(N, K // G, G), hi.float().reshape(shape))
    return torch.maximum(clamped, lo.float().reshape(shape)).reshape(N, K).to(W.dtype)


def awq_search_clip(
    X: torch.Tensor,
    W: torch.Tensor,
    scheme: QuantScheme,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group clamp range ``(lo, hi)``, float32 ``[N, K/G]`` each, for ``W [N, K]`` reading ``X [T, K]``.

    Every ``ceil(T / n_tokens)``-th token is used (at most ~``n_tokens``). See the module docstring.
    """
    _check_inputs(X, [W], scheme)
    _check_grid(n_grid)
    if not 0.0 <= max_shrink < 1.0:
        raise QinferError(f"AWQ clip: max_shrink must be in [0, 1), got {max_shrink!r}")
    if type(n_tokens) is not int or n_tokens < 1:
        raise QinferError(f"AWQ clip: n_tokens must be a positive int, got {n_tokens!r}")
    Xs = X.float()[:: -(-X.shape[0] // n_tokens)]
    T = Xs.shape[0]
    G, n_groups = _groups_of(W, scheme.group_size)
    Xg = Xs.reshape(T, n_groups, G).transpose(0, 1)  # [groups, T, G]
    rows = max(1, _CHUNK // (n_groups * T))

    def group_error(D: torch.Tensor) -> torch.Tensor:  # D: [N, groups, G] -> [N, groups]
        err = torch.empty(D.shape[:2])
        for r in range(0, D.shape[0], rows):
            Dg = D[r : r + rows].permute(1, 2, 0)  # [groups, G, rows]
            err[r : r + rows] = torch.bmm(Xg, Dg).pow(2).mean(dim=1).T  # group outputs' error [rows, groups]
        return err

    return _search_clip(W, scheme, n_grid, max_shrink, group_error)


def awq_search_clip_gram(
    gram: torch.Tensor, W: torch.Tensor, scheme: QuantScheme, n_grid: int = 20, max_shrink: float = 0.5,
    name: str | None = None, sweeps: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`awq_search_clip` on all calibration tokens via ``gram = X^T X [K, K]``: a group's output error is
    ``D_g H_gg D_g^T`` with ``H_gg`` the group's diagonal block, ``N K G`` work per grid step. Then ``sweeps``
    passes over the groups re-pick each group's range for the whole linear's output error (see the module
    docstring); ``sweeps=0`` keeps the per-group picks. ``name`` (the linear's) labels errors."""
    _check_int_scheme(scheme)
    _check_grid(n_grid)
    if not 0.0 <= max_shrink < 1.0:
        raise QinferError(f"AWQ clip: max_shrink must be in [0, 1), got {max_shrink!r}")
    if type(sweeps) is not int or sweeps < 0:
        raise QinferError(f"AWQ clip: sweeps must be an int >= 0, got {sweeps!r}")
    _check_gram(gram, [W], scheme, _label([name] if name else None))
    G, n_groups = _groups_of(W, scheme.group_size)
    H = gram.float()
    idx = torch.arange(n_groups)
    blocks = H.reshape(n_groups, G, n_groups, G)[idx, :, idx, :]  # [groups, G, G]

    def group_error(D: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ngk,gkl,ngl->ng", D, blocks, D)

    lo, hi = _search_clip(W, scheme, n_grid, max_shrink, group_error)
    if n_groups > 1 and sweeps:
        _clip_sweeps(W, H, scheme, n_grid, max_shrink, lo, hi, sweeps)
    return lo, hi


def _clip_grid(W, scheme, n_grid, max_shrink):
    """The clip search's starting ranges ``lo0, hi0 [N, groups]`` and its (lo, hi) shrink pairs."""
    N, K = W.shape
    G, n_groups = _groups_of(W, scheme.group_size)
    g = W.float().reshape(N, n_groups, G)
    if scheme.symmetric:
        hi0 = g.abs().amax(dim=-1)  # [N, groups]
        lo0 = -hi0
    else:
        lo0, hi0 = g.amin(dim=-1).clamp(max=0.0), g.amax(dim=-1).clamp(min=0.0)
    steps = [1.0 - i / n_grid for i in range(int(round(max_shrink * n_grid)) + 1)]
    pairs = [(p, p) for p in steps] if scheme.symmetric else [(p, q) for p in steps for q in steps]
    return lo0, hi0, pairs


def _round_clamped(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``fake_quantize`` of groups ``x [..., G]`` clamped to ``[lo, hi] [...]``, float32: the same values, without
    its reductions. A clamped group's min and max are ``lo`` and ``hi`` (``lo <= min(x, 0)`` unless clamping,
    likewise ``hi``), so its grid is the one ``rtn_params`` gives the pair ``(lo, hi)``."""
    scale, zero = rtn_params(torch.stack([lo, hi], dim=-1).reshape(-1, 2), scheme.bits, -1, scheme.symmetric)
    scale, zero = scale.float().reshape(lo.shape)[..., None], zero.float().reshape(lo.shape)[..., None]
    q = torch.maximum(torch.minimum(x, hi[..., None]), lo[..., None])
    return q.div_(scale).add_(zero).round_().clamp_(0, (1 << scheme.bits) - 1).sub_(zero).mul_(scale)


def _search_clip(W, scheme, n_grid, max_shrink, group_error) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = W.shape
    G, n_groups = _groups_of(W, scheme.group_size)
    Wf = W.float()
    lo0, hi0, pairs = _clip_grid(W, scheme, n_grid, max_shrink)
    best_lo, best_hi = lo0.clone(), hi0.clone()
    best_err = torch.full_like(hi0, math.inf)
    g = Wf.reshape(N, n_groups, G)
    for p, q in pairs:
        lo, hi = lo0 * p, hi0 * q
        err = group_error(g - _round_clamped(g, lo, hi, scheme))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
    return best_lo, best_hi


def _clip_sweeps(W, H, scheme, n_grid, max_shrink, lo, hi, sweeps) -> None:
    """``sweeps`` passes over ``W``'s groups, in place on ``lo, hi [N, groups]``: each group in turn takes the grid
    pair whose whole-row output error ``D H D^T`` is least with the other groups' errors as they stand."""
    N, K = W.shape
    G, n_groups = _groups_of(W, scheme.group_size)
    Wf = W.float()
    lo0, hi0, pairs = _clip_grid(W, scheme, n_grid, max_shrink)
    P, Q = torch.tensor(pairs).T  # [pairs] each
    g = Wf.reshape(N, n_groups, G)
    D = (g - _round_clamped(g, lo, hi, scheme)).reshape(N, K)  # kept current as groups change
    chunk = max(1, _CHUNK // (4 * N * G))  # pairs scored at once
    for j in list(range(n_groups)) * sweeps:
        cols = slice(j * G, (j + 1) * G)
        H_jj = H[cols, cols]
        # D H D^T = d H_jj d^T + 2 d . cross + (terms without d), d = D[:, cols]; cross: the others' errors
        cross = D @ H[:, cols] - D[:, cols] @ H_jj  # [N, G]
        Wj = Wf[:, cols]
        errors = []
        for c in range(0, len(pairs), chunk):
            lo_c = lo0[:, j] * P[c : c + chunk, None]  # [c, N]
            hi_c = hi0[:, j] * Q[c : c + chunk, None]
            d = Wj - _round_clamped(Wj, lo_c, hi_c, scheme)  # [c, N, G]
            errors.append(((d @ H_jj + 2 * cross) * d).sum(-1))  # [c, N]
        pick = torch.cat(errors).argmin(dim=0)  # [N]; the first of equal errors, as in _search_clip
        lo[:, j], hi[:, j] = lo0[:, j] * P[pick], hi0[:, j] * Q[pick]
        D[:, cols] = Wj - _round_clamped(Wj, lo[:, j], hi[:, j], scheme)


# ---------------------------------------------------------------------------------------------- folding


def _check_scales(s: torch.Tensor, K: int, what: str) -> torch.Tensor:
    if s.dim() != 1 or s.shape[0] != K:
        raise QinferError(f"{what}: scales have shape {list(s.shape)}, expected [{K}]")
    check_finite(s, f"{what}: scales")
    if bool((s <= 0).any()):
        raise QinferError(f"{what}: scales must be positive; pass AwqScaleResult.scales")
    return s.float()


def fold_scales_into_norm(
    weight: torch.Tensor, s: torch.Tensor, *, offset: float = 0.0, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide a norm's output by ``s``: returns the new ``(weight, bias)`` in their original dtypes.

    The norm multiplies by ``offset + weight`` (``offset`` 0 for Llama-style RMSNorm, 1 for Gemma's
    ``(1 + w)``), so the stored weight becomes ``(offset + weight) / s - offset``; a LayerNorm bias
    becomes ``bias / s``.
    """
    s = _check_scales(s, weight.shape[-1], "fold_scales_into_norm")
    new_weight = ((offset + weight.float()) / s - offset).to(weight.dtype)
    new_bias = None if bias is None else (bias.float() / s).to(bias.dtype)
    return new_weight, new_bias


def fold_scales_into_linear(
    weight: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide the outputs of a preceding linear ``weight [K, K_in]`` by ``s [K]``: rows and bias, original dtypes."""
    s = _check_scales(s, weight.shape[0], "fold_scales_into_linear")
    new_weight = (weight.float() / s[:, None]).to(weight.dtype)
    new_bias = None if bias is None else (bias.float() / s).to(bias.dtype)
    return new_weight, new_bias


def fold_scales_into_quantized(qw: QuantizedWeight, s: torch.Tensor) -> QuantizedWeight | None:
    """Divide the outputs of an already-quantized linear ``[K, K_in]`` by ``s [K]``: row ``k``'s float16 group
    scales are divided by ``s_k`` (codes and zero points, which are in code units, stay). Exact up to the
    float16 rounding of the new scales; None when a new scale would leave float16's normal range, where that
    rounding is no longer relative (the caller then leaves this input unscaled). Groups at RTN's least scale
    (all-zero groups: every code dequantizes to within 15 x 2^-24 of 0) keep it and are left out of that check."""
    s = _check_scales(s, qw.shape[0], "fold_scales_into_quantized")
    least = qw.scale.float() <= LEAST_SCALE
    scale = torch.where(least, qw.scale.float(), qw.scale.float() / s[:, None])
    out_of_range = (scale.abs() > FP16_MAX) | ((scale != 0) & (scale.abs() < FP16_MIN_NORMAL))
    if bool((out_of_range & ~least).any()):
        return None
    return dataclasses.replace(qw, scale=scale.half())


def scale_linear_inputs(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Multiply the input columns of a following linear ``weight [N, K]`` by ``s [K]`` (original dtype)."""
    s = _check_scales(s, weight.shape[-1], "scale_linear_inputs")
    return (weight.float() * s).to(weight.dtype)
