"""AWQ is judged by held-out output error against plain RTN on inputs with salient channels, by the exact
equivalence of its folding, and by the guarantees of its grids (ratio 0 is RTN, clip 1.0 is no clip)."""

import math

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import QuantScheme
from qinfer.quantizers.awq import (
    apply_clip,
    awq_search_clip,
    awq_search_scales,
    fake_quantize,
    fold_scales_into_linear,
    fold_scales_into_norm,
    fold_scales_into_quantized,
    scale_linear_inputs,
)
from qinfer.quantizers.rtn import rtn_quantize

K = 256


def _problem(seed=0, Ns=(96, 64), T=512, n_salient=8, boost=20.0):
    """Calibration and held-out inputs whose few salient channels carry ~20x the typical magnitude (the
    AWQ paper's premise), and two linears reading them (like gate_proj and up_proj)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(K, generator=g) * 0.5 + 0.5
    mag[torch.randperm(K, generator=g)[:n_salient]] *= boost
    X = torch.randn(2 * T, K, generator=g) * mag
    Ws = [torch.randn(n, K, generator=g) * 0.05 for n in Ns]
    return X[:T], X[T:], Ws


def _out_err(X, Ws, W_hats):
    """Mean squared output error over all linears."""
    total = sum(float((X @ (w - h).T).pow(2).sum()) for w, h in zip(Ws, W_hats))
    return total / (X.shape[0] * sum(w.shape[0] for w in Ws))


def _rel_err(X, Ws, W_hats):
    """Each linear's relative output error, averaged over all the linears' rows (the search's default objective)."""
    total = sum(w.shape[0] * float((X @ (w - h).T).pow(2).sum() / (X @ w.T).pow(2).sum()) for w, h in zip(Ws, W_hats))
    return total / sum(w.shape[0] for w in Ws)


def _scheme(bits=4, group_size=128, symmetric=True):
    return QuantScheme(method="awq", bits=bits, group_size=group_size, symmetric=symmetric)


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_beats_rtn_on_held_out_tokens(bits, group_size, symmetric):
    X_cal, X_test, Ws = _problem()
    scheme = _scheme(bits, group_size, symmetric)
    res = awq_search_scales(X_cal, Ws, scheme)
    s = res.scales
    assert s.dtype == torch.float32 and s.shape == (K,) and bool((s > 0).all())
    e_rtn = _out_err(X_test, Ws, [rtn_quantize(w, scheme).dequantize(torch.float32) for w in Ws])
    # what the deployed model computes: RTN of W s, with 1/s folded into the input
    deployed = [rtn_quantize(scale_linear_inputs(w, s), scheme).dequantize(torch.float32) / s for w in Ws]
    e_awq = _out_err(X_test, Ws, deployed)
    # Observed 0.39-0.59 (asymmetric grids gain more: 0.39-0.44; symmetric 0.53-0.59), best ratio 0.15-0.35.
    assert e_awq <= 0.8 * e_rtn, e_awq / e_rtn
    assert 0.0 < res.ratio < 1.0


@pytest.mark.parametrize("bits", [4, 3])
def test_clipping_after_scaling_helps_further(bits):
    X_cal, X_test, Ws = _problem(seed=1)
    scheme = _scheme(bits)
    s = awq_search_scales(X_cal, Ws, scheme).scales
    scaled = [scale_linear_inputs(w, s) for w in Ws]
    clipped = [apply_clip(w, *awq_search_clip(X_cal / s, w, scheme)) for w in scaled]
    e_scaled = _out_err(X_test, Ws, [fake_quantize(w, scheme) / s for w in scaled])
    e_clipped = _out_err(X_test, Ws, [fake_quantize(w, scheme) / s for w in clipped])
    e_rtn = _out_err(X_test, Ws, [fake_quantize(w, scheme) for w in Ws])
    # Observed: scales alone 0.52 / 0.57 x RTN, scales + clip 0.47 / 0.53 x RTN (4 / 3 bits).
    assert e_clipped < e_scaled <= 0.8 * e_rtn, (e_clipped / e_rtn, e_scaled / e_rtn)


def test_ratio_zero_is_plain_rtn():
    X_cal, _, Ws = _problem()
    scheme = _scheme(3, 128, False)
    assert torch.equal(fake_quantize(Ws[0], scheme), rtn_quantize(Ws[0], scheme).dequantize(torch.float32))
    res = awq_search_scales(X_cal, Ws, scheme, n_grid=1)
    assert res.ratios == (0.0,) and res.ratio == 0.0
    assert torch.equal(res.scales, torch.ones(K))
    e_rtn = _rel_err(X_cal, Ws, [rtn_quantize(w, scheme).dequantize(torch.float32) for w in Ws])
    assert res.errors[0] == pytest.approx(e_rtn, rel=1e-6)
    # and the full grid starts from that same point, so the search never does worse than RTN on its data
    full = awq_search_scales(X_cal, Ws, scheme)
    assert full.errors[0] == pytest.approx(e_rtn, rel=1e-6)
    assert full.error <= full.errors[0]


@pytest.mark.parametrize("search", ["activations", "gram"])
def test_the_scale_search_weighs_each_linear_by_its_relative_error(search):
    from qinfer.quantizers.awq import awq_search_scales_gram

    X_cal, _, Ws = _problem(seed=4)
    scheme = _scheme(4, 128, False)

    def run(ws):
        if search == "activations":
            return awq_search_scales(X_cal, ws, scheme, n_grid=10)
        return awq_search_scales_gram(X_cal.abs().mean(0), X_cal.T @ X_cal, ws, scheme, n_grid=10)

    res = run(Ws)
    # a linear whose outputs are 1024x larger (a power of 2: its rounding scales exactly) gets no more say
    for i in range(2):
        louder = [w * 1024.0 if j == i else w for j, w in enumerate(Ws)]
        other = run(louder)
        assert other.ratio == res.ratio and other.errors == pytest.approx(res.errors, rel=1e-4)
    # an all-zero linear quantizes exactly and is left out rather than dividing by zero
    with_zero = run(Ws + [torch.zeros(32, K)])
    assert all(math.isfinite(e) for e in with_zero.errors) and with_zero.ratio == res.ratio
    total_rows = sum(w.shape[0] for w in Ws)
    assert with_zero.errors == pytest.approx([e * total_rows / (total_rows + 32) for e in res.errors], rel=1e-5)


def test_result_is_the_argmin_of_its_curve():
    X_cal, _, Ws = _problem(seed=2)
    scheme = _scheme()
    res = awq_search_scales(X_cal, Ws, scheme, n_grid=10)
    assert res.ratios == tuple(i / 10 for i in range(10))
    assert len(res.errors) == 10 and all(math.isfinite(e) for e in res.errors)
    best = min(range(10), key=lambda i: res.errors[i])
    assert res.ratio == res.ratios[best] and res.error == res.errors[best]
    # the reported error is the objective evaluated at the returned scales
    s = res.scales
    assert _rel_err(X_cal, Ws, [fake_quantize(w * s, scheme) / s for w in Ws]) == pytest.approx(res.error, rel=1e-5)
    # normalised to straddle 1: max * min == 1
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


def test_forward_objective():
    X_cal, _, Ws = _problem(seed=3)
    scheme = _scheme()
    default = awq_search_scales(X_cal, Ws, scheme, n_grid=8)
    # a forward that returns the linears' stacked outputs, each weighed by sqrt(N_i) over its output's norm,
    # measures the same thing as the default (its mean over T tokens is the default's error / T)
    norms = [float(math.sqrt(w.shape[0])) / float((X_cal @ w.T).norm()) for w in Ws]
    stacked = awq_search_scales(X_cal, Ws, scheme, lambda ws: torch.cat([X_cal @ w.T * n for w, n in zip(ws, norms)], 1),
                                n_grid=8)
    assert stacked.ratio == default.ratio
    T = X_cal.shape[0]
    assert [e * T for e in stacked.errors] == pytest.approx(default.errors, rel=1e-4)

    # a gated MLP block (SiLU(x Wg^T) * x Wu^T): the search optimises the block output instead
    calls = []

    def mlp(ws):
        calls.append([w.clone() for w in ws])
        g, u = X_cal @ ws[0].T, X_cal @ ws[1][:128].T
        return torch.nn.functional.silu(g) * u

    Wg, Wu = torch.randn(128, K), torch.randn(128, K)
    res = awq_search_scales(X_cal, [Wg, Wu], scheme, mlp, n_grid=8)
    assert len(calls) == 9  # the reference, then one call per ratio
    assert torch.equal(calls[0][0], Wg) and torch.equal(calls[0][1], Wu)
    assert res.error < res.errors[0]  # beats ratio 0 = RTN on the block output


def test_duo_scaling_grid():
    X_cal, X_test, Ws = _problem()
    scheme = _scheme()
    res = awq_search_scales(X_cal, Ws, scheme, duo_scaling=True)
    # AutoAWQ's candidates x_mean^r / w_mean^(1-r), w_mean the mean over rows of |W| over its group's absmax,
    # each normalised to max * min = 1 (written out here; ratio 0 is 1 / w_mean, not 1)
    W = torch.cat(Ws).abs()
    g = W.reshape(W.shape[0], -1, scheme.group_size)
    w_mean = (g / g.amax(-1, keepdim=True)).reshape(W.shape).mean(0)

    def candidate(ratio):
        s = X_cal.abs().mean(0).pow(ratio) / w_mean.pow(1 - ratio)
        return s / (s.max() * s.min()).sqrt()

    assert torch.allclose(res.scales, candidate(res.ratio), rtol=1e-3)
    only_ratio_0 = awq_search_scales(X_cal, Ws, scheme, duo_scaling=True, n_grid=1)
    assert torch.allclose(only_ratio_0.scales, candidate(0.0), rtol=1e-3)
    s = res.scales
    # it also finds scales far better than RTN
    e_rtn = _out_err(X_test, Ws, [fake_quantize(w, scheme) for w in Ws])
    assert _out_err(X_test, Ws, [fake_quantize(w * s, scheme) / s for w in Ws]) <= 0.8 * e_rtn


def test_unstorable_candidates_are_skipped():
    # Channels 1e12 apart: at high ratios W s needs float16 scales past 65504; those ratios are marked inf.
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 64, generator=g)
    X[:, 0] *= 1e12
    W = torch.randn(16, 64, generator=g)
    res = awq_search_scales(X, [W], _scheme(group_size=32), n_grid=10)
    assert math.isinf(res.errors[-1]) and math.isfinite(res.errors[0])
    assert math.isfinite(res.error) and bool(torch.isfinite(res.scales).all())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_clip_never_increases_a_groups_error(symmetric, group_size):
    X_cal, _, Ws = _problem(seed=4, T=600)
    W = Ws[0]
    scheme = _scheme(3, group_size, symmetric)
    lo, hi = awq_search_clip(X_cal, W, scheme, n_tokens=200)
    G = K if group_size == -1 else group_size
    N, n_groups = W.shape[0], K // G
    assert lo.shape == hi.shape == (N, n_groups) and lo.dtype == hi.dtype == torch.float32
    g = W.reshape(N, n_groups, G)
    lo0, hi0 = (-g.abs().amax(-1), g.abs().amax(-1)) if symmetric else (g.amin(-1), g.amax(-1))
    # each end moves inwards by at most max_shrink = 0.5 (as a fraction of its distance from 0)
    for end, end0 in ((lo, lo0), (hi, hi0)):
        kept = end / end0
        assert bool((kept >= 0.5 - 1e-6).all()) and bool((kept <= 1.0).all())
    assert bool((hi < hi0).any()) and bool((lo > lo0).any())  # some groups did clip, on both sides
    if symmetric:
        assert torch.equal(lo, -hi)
    else:  # the two ends are narrowed independently
        assert bool(((lo / lo0 - hi / hi0).abs() > 0.01).any())

    # per-group output error on the search's token subsample (every 3rd of 600 tokens), written out directly
    Xs = X_cal[::3]

    def group_err(W_hat):
        D = (W - W_hat).reshape(N, n_groups, G)
        Xg = Xs.reshape(-1, n_groups, G)
        return torch.einsum("tgj,ngj->tng", Xg, D).pow(2).mean(0)

    e_clip = group_err(fake_quantize(apply_clip(W, lo, hi), scheme))
    e_none = group_err(fake_quantize(W, scheme))
    assert bool((e_clip <= e_none * (1 + 1e-5)).all()), (e_clip / e_none).max()
    # and the whole linear's output error on those tokens goes down too
    e_total_clip = _out_err(Xs, [W], [fake_quantize(apply_clip(W, lo, hi), scheme)])
    assert e_total_clip < _out_err(Xs, [W], [fake_quantize(W, scheme)])


def test_asymmetric_clip_beats_the_symmetric_clamp():
    """On an asymmetric grid, narrowing each end on its own beats AutoAWQ's symmetric clamp (the best of its
    steps per group, rounded on the same grid) on the search's objective, the calibration output error."""
    X_cal, _, Ws = _problem(seed=6, T=512)
    W = Ws[1] + 0.02  # skewed groups: one side reaches further than the other
    scheme = _scheme(4, 32, symmetric=False)
    N, n_groups = W.shape[0], K // 32
    Xg = X_cal.reshape(-1, n_groups, 32)

    def group_err(W_hat):
        return torch.einsum("tgj,ngj->tng", Xg, (W - W_hat).reshape(N, n_groups, 32)).pow(2).mean(0)

    m = W.abs().reshape(N, n_groups, 32).amax(-1)
    e_sym = torch.stack([group_err(fake_quantize(apply_clip(W, -m * (1 - i / 20), m * (1 - i / 20)), scheme))
                         for i in range(11)]).amin(0)
    e_asym = group_err(fake_quantize(apply_clip(W, *awq_search_clip(X_cal, W, scheme, n_tokens=512)), scheme))
    # Observed: 0.68 of the symmetric clamp's error in total.
    assert float(e_asym.sum()) < 0.85 * float(e_sym.sum()), float(e_asym.sum() / e_sym.sum())


def test_clip_grid_endpoints():
    X_cal, _, Ws = _problem(seed=5, T=128)
    W = Ws[1]
    for symmetric in (True, False):
        scheme = _scheme(4, 64, symmetric)
        g = W.reshape(W.shape[0], -1, 64)
        lo0, hi0 = (-g.abs().amax(-1), g.abs().amax(-1)) if symmetric else (g.amin(-1), g.amax(-1))
        # max_shrink 0: only the no-op clamp is tried
        assert all(torch.equal(a, b) for a, b in zip(awq_search_clip(X_cal, W, scheme, max_shrink=0.0), (lo0, hi0)))
        # every chosen end lies on the grid end * (1 - i / n_grid), i = 0..5
        lo, hi = awq_search_clip(X_cal, W, scheme, n_grid=10, max_shrink=0.5)
        for end, end0 in ((lo, lo0), (hi, hi0)):
            steps = (1 - end / end0) * 10
            assert bool((steps - steps.round()).abs().max() < 1e-4) and int(steps.round().max()) <= 5
        # the last step, 1 - max_shrink, is tried too (AutoAWQ stops one short): some groups here take it
        assert max(int(((1 - end / end0) * 10).round().max()) for end, end0 in ((lo, lo0), (hi, hi0))) == 5


def test_apply_clip():
    W = torch.tensor([[3.0, -4.0, 1.0, 0.5], [-0.2, 0.1, 9.0, -9.0]]).half()
    lo = torch.tensor([[-2.0, -0.75], [-0.15, -20.0]])
    hi = torch.tensor([[2.5, 0.75], [0.15, 4.0]])
    out = apply_clip(W, lo, hi)
    assert out.dtype == torch.float16
    assert torch.equal(out.float(), torch.tensor([[2.5, -2.0, 0.75, 0.5], [-0.15, 0.1, 4.0, -9.0]]).half().float())
    with pytest.raises(QinferError, match="whole groups"):
        apply_clip(W, torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(QinferError, match="contain 0"):
        apply_clip(W, -torch.ones(2, 2), -torch.ones(2, 2))


# ---------------------------------------------------------------------------------------------- folding


def _rms_norm(x, weight, offset, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama-style w, Gemma-style (1 + w)
def test_folding_into_a_norm_keeps_the_function(offset):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, K, generator=g)
    norm_w = torch.randn(K, generator=g) * 0.3 + (1.0 - offset)
    Wq, Wk = torch.randn(64, K, generator=g), torch.randn(48, K, generator=g)
    s = torch.exp(torch.randn(K, generator=g))  # spans ~e^-3 .. e^3
    new_norm, no_bias = fold_scales_into_norm(norm_w, s, offset=offset)
    assert no_bias is None and new_norm.dtype == norm_w.dtype
    assert torch.allclose(offset + new_norm, (offset + norm_w) / s, rtol=1e-6, atol=1e-7)
    h, h_new = _rms_norm(x, norm_w, offset), _rms_norm(x, new_norm, offset)
    for W in (Wq, Wk):
        ref = h @ W.T
        assert torch.allclose(h_new @ scale_linear_inputs(W, s).T, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


def test_folding_with_a_layernorm_bias():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, K, generator=g)
    w, b = torch.randn(K, generator=g), torch.randn(K, generator=g)
    W = torch.randn(32, K, generator=g)
    s = torch.rand(K, generator=g) + 0.2
    ln = torch.nn.functional.layer_norm
    w2, b2 = fold_scales_into_norm(w, s, bias=b)
    ref = ln(x, (K,), w, b) @ W.T
    assert torch.allclose(ln(x, (K,), w2, b2) @ scale_linear_inputs(W, s).T, ref, rtol=1e-5, atol=1e-4)


def test_folding_into_a_preceding_linear_keeps_the_function():
    # up_proj -> down_proj (with a bias on the producer, as some architectures have)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=g)
    W1, b1 = torch.randn(K, 64, generator=g), torch.randn(K, generator=g)
    W2 = torch.randn(40, K, generator=g)
    s = torch.exp(torch.randn(K, generator=g))
    W1s, b1s = fold_scales_into_linear(W1, s, b1)
    ref = (x @ W1.T + b1) @ W2.T
    got = (x @ W1s.T + b1s) @ scale_linear_inputs(W2, s).T
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    # dtype is kept
    W1h, none = fold_scales_into_linear(W1.half(), s)
    assert W1h.dtype == torch.float16 and none is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_folding_into_a_quantized_linear_scales_its_rows(symmetric):
    # up_proj already quantized when down_proj's scales are searched: 1/s goes into its group scales' rows
    g = torch.Generator().manual_seed(4)
    qw = rtn_quantize(torch.randn(K, 64, generator=g) * 0.05, QuantScheme(bits=4, group_size=32, symmetric=symmetric))
    s = torch.exp(torch.randn(K, generator=g))
    folded = fold_scales_into_quantized(qw, s)
    assert torch.equal(folded.qweight, qw.qweight) and (folded.zero is None) == symmetric
    before, after = qw.dequantize(torch.float32), folded.dequantize(torch.float32)
    torch.testing.assert_close(after, before / s[:, None], rtol=2.0**-11, atol=0.0)  # float16 rounding of the scales
    # a scale pushed out of float16's normal range cannot be folded
    assert fold_scales_into_quantized(qw, torch.full((K,), 1e-7)) is None
    assert fold_scales_into_quantized(qw, torch.full((K,), 1e7)) is None
    with pytest.raises(QinferError, match="shape"):
        fold_scales_into_quantized(qw, torch.ones(K + 1))


def test_an_all_zero_group_does_not_stop_folding_into_a_quantized_linear():
    # RTN gives an all-zero group the least float16 scale, below the normal range: any scale reproduces its zeros
    g = torch.Generator().manual_seed(5)
    W = torch.randn(K, 64, generator=g) * 0.05
    W[3, :32] = 0  # a pruned row's group
    qw = rtn_quantize(W, QuantScheme(bits=4, group_size=32))
    s = torch.exp(torch.randn(K, generator=g) * 0.5)
    folded = fold_scales_into_quantized(qw, s)
    assert folded is not None
    after = folded.dequantize(torch.float32)
    torch.testing.assert_close(after, qw.dequantize(torch.float32) / s[:, None], rtol=2.0**-11, atol=0.0)
    assert not after[3, :32].any()


def test_search_then_fold_reproduces_the_searched_error():
    # The searched error is what the folded, RTN-quantized block actually produces on its inputs.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, K, generator=g) * (1 + 19 * (torch.rand(K, generator=g) < 0.03))
    norm_w = torch.rand(K, generator=g) + 0.5
    Ws = [torch.randn(64, K, generator=g) * 0.05, torch.randn(32, K, generator=g) * 0.05]
    scheme = _scheme(4, 64)
    h = _rms_norm(x, norm_w, 0.0)
    res = awq_search_scales(h, Ws, scheme)
    new_norm, _ = fold_scales_into_norm(norm_w, res.scales)
    h_folded = _rms_norm(x, new_norm, 0.0)
    q = [rtn_quantize(scale_linear_inputs(w, res.scales), scheme).dequantize(torch.float32) for w in Ws]
    err = sum(w.shape[0] * float((h @ w.T - h_folded @ wq.T).pow(2).sum() / (h @ w.T).pow(2).sum())
              for w, wq in zip(Ws, q)) / 96
    assert err == pytest.approx(res.error, rel=1e-3)


# ---------------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise():
    X_cal, _, Ws = _problem(T=64)
    scheme = _scheme()
    bad = X_cal.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(QinferError, match="calibration inputs contains NaN"):
        awq_search_scales(bad, Ws, scheme)
    with pytest.raises(QinferError, match="calibration inputs contains NaN"):
        awq_search_clip(bad, Ws[0], scheme)
    W = Ws[0].clone()
    W[0, 0] = float("inf")
    with pytest.raises(QinferError, match=r"weights\[0\]: weight contains NaN or Inf"):
        awq_search_scales(X_cal, [W], scheme)

    def nan_after_the_reference(ws):
        return X_cal @ ws[0].T * (1.0 if torch.equal(ws[0], Ws[0]) else math.nan)

    with pytest.raises(QinferError, match="forward\\(candidate weights\\) contains NaN"):
        awq_search_scales(X_cal, Ws, scheme, nan_after_the_reference)
    with pytest.raises(QinferError, match="in_features 128 != the inputs' K=256"):
        awq_search_scales(X_cal, [torch.randn(8, 128)], scheme)
    with pytest.raises(QinferError, match="integer scheme"):
        awq_search_scales(X_cal, Ws, QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1))
    with pytest.raises(QinferError, match="n_grid"):
        awq_search_scales(X_cal, Ws, scheme, n_grid=0)
    with pytest.raises(QinferError, match="max_shrink"):
        awq_search_clip(X_cal, Ws[0], scheme, max_shrink=1.0)
    with pytest.raises(QinferError, match="scales contains NaN"):
        fold_scales_into_norm(torch.ones(K), torch.full((K,), float("nan")))
    with pytest.raises(QinferError, match="positive"):
        scale_linear_inputs(Ws[0], torch.zeros(K))
    with pytest.raises(QinferError, match=r"scales have shape \[256\], expected \[96\]"):
        fold_scales_into_linear(Ws[0], torch.ones(K))



def test_gram_search_errors_name_the_linears():
    from qinfer.quantizers.awq import awq_search_clip_gram, awq_search_scales_gram

    X_cal, _, Ws = _problem(T=64)
    scheme, names = _scheme(), ["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"]
    gram = X_cal.T @ X_cal
    gram[1, 2] = float("inf")
    with pytest.raises(QinferError, match=r"^model\.layers\.3\.mlp\.gate_proj/up_proj: Gram matrix .*overflow"):
        awq_search_scales_gram(X_cal.abs().mean(0), gram, Ws[:2], scheme, names=names)
    with pytest.raises(QinferError, match=r"^model\.layers\.3\.mlp\.up_proj: Gram matrix"):
        awq_search_clip_gram(gram, Ws[1], scheme, name=names[1])
    huge = Ws[1].clone()
    huge[0, 0] = 1e30  # finite, but past any float16 scale at every ratio: the one linear holding it is named
    with pytest.raises(QinferError, match=r"^model\.layers\.3\.mlp\.up_proj: weights too large"):
        awq_search_scales_gram(X_cal.abs().mean(0), X_cal.T @ X_cal, [Ws[0], huge], scheme, names=names)

@pytest.mark.parametrize("bits,symmetric", [(4, True), (3, False)])
def test_gram_searches_choose_what_the_activation_searches_choose(bits, symmetric):
    from qinfer.quantizers.awq import awq_search_clip_gram, awq_search_scales_gram

    gen = torch.Generator().manual_seed(3)
    X = torch.randn(256, 128, generator=gen)
    X[:, :4] *= 20  # salient channels
    Ws = [torch.randn(48, 128, generator=gen) * 0.05, torch.randn(16, 128, generator=gen) * 0.05]
    scheme = QuantScheme(method="awq", bits=bits, group_size=32, symmetric=symmetric)
    by_x = awq_search_scales(X, Ws, scheme)
    by_gram = awq_search_scales_gram(X.abs().mean(0), X.T @ X, Ws, scheme)
    assert by_gram.ratio == by_x.ratio
    torch.testing.assert_close(by_gram.scales, by_x.scales)
    W = Ws[0] * by_x.scales
    clip_x = awq_search_clip(X / by_x.scales, W, scheme, n_tokens=256)
    Xs = X / by_x.scales
    clip_gram = awq_search_clip_gram(Xs.T @ Xs, W, scheme, sweeps=0)  # the per-group picks alone
    for by_x_end, by_gram_end in zip(clip_x, clip_gram):
        assert float((by_x_end == by_gram_end).float().mean()) > 0.95  # equal up to float ties


def _correlated_problem(seed, N, T=512):
    """Inputs sharing a common component (as normed activations do), so groups' output errors add up
    with cross terms, and a weight reading them."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, K, generator=g) + 0.8 * torch.randn(T, 1, generator=g)
    X[:, :4] *= 10
    return X.T @ X / T, torch.randn(N, K, generator=g) * 0.05


def _row_errors(W, W_hat, H):
    D = (W - W_hat).double()
    return ((D @ H.double()) * D).sum(1)  # [N]: each row's output error over the calibration tokens


@pytest.mark.parametrize("bits,symmetric", [(4, False), (3, True), (2, False), (8, False), (4, True)])
def test_the_clip_searches_round_a_clamped_group_as_fake_quantize_does(bits, symmetric):
    """The searches round a clamped group on the grid of its two ends, skipping fake_quantize's reductions:
    the same values to the bit, also for all-zero, one-signed and unclamped groups."""
    from qinfer.quantizers.awq import _round_clamped

    g = torch.Generator().manual_seed(9)
    W = torch.randn(24, K, generator=g) * 0.05
    W[0] = 0.0
    W[1, :64], W[2, 32:96] = W[1, :64].abs(), -W[2, 32:96].abs()
    scheme = _scheme(bits, 32, symmetric)
    x = W.reshape(24, K // 32, 32)
    m = x.abs().amax(-1)
    ends0 = (-m, m) if symmetric else (x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0))
    shrink = torch.rand(2, 24, K // 32, generator=g) * 0.5 + 0.5
    shrink[:, :, 0] = 1.0  # unclamped groups too
    lo, hi = ends0[0] * shrink[0], ends0[1] * (shrink[0] if symmetric else shrink[1])
    assert torch.equal(_round_clamped(x, lo, hi, scheme).reshape(W.shape), fake_quantize(apply_clip(W, lo, hi), scheme))


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_sweeps_match_a_brute_force_coordinate_descent(symmetric):
    """Each sweep re-picks every group's range, in order, for the whole row's output error; written out here
    row by row and pair by pair, scored in float64 on the full quantized row."""
    from qinfer.quantizers.awq import awq_search_clip_gram

    H, W = _correlated_problem(seed=7, N=8)
    scheme = _scheme(3, 64, symmetric)
    n_grid, G, n_groups = 10, 64, K // 64
    lo, hi = awq_search_clip_gram(H, W, scheme, n_grid=n_grid, max_shrink=0.3, sweeps=0)
    picks = lo.clone(), hi.clone()
    g = W.reshape(-1, n_groups, G)
    lo0, hi0 = (-g.abs().amax(-1), g.abs().amax(-1)) if symmetric else (g.amin(-1), g.amax(-1))
    steps = [1 - i / n_grid for i in range(4)]
    pairs = [(p, p) for p in steps] if symmetric else [(p, q) for p in steps for q in steps]
    for _ in range(2):
        for j in range(n_groups):
            for n in range(W.shape[0]):
                errors = []
                for p, q in pairs:
                    row_lo, row_hi = lo[n : n + 1].clone(), hi[n : n + 1].clone()
                    row_lo[0, j], row_hi[0, j] = lo0[n, j] * p, hi0[n, j] * q
                    W_hat = fake_quantize(apply_clip(W[n : n + 1], row_lo, row_hi), scheme)
                    errors.append(float(_row_errors(W[n : n + 1], W_hat, H)[0]))
                p, q = pairs[min(range(len(pairs)), key=errors.__getitem__)]
                lo[n, j], hi[n, j] = lo0[n, j] * p, hi0[n, j] * q
    fast_lo, fast_hi = awq_search_clip_gram(H, W, scheme, n_grid=n_grid, max_shrink=0.3, sweeps=2)
    assert torch.equal(fast_lo, lo) and torch.equal(fast_hi, hi)
    assert not (torch.equal(lo, picks[0]) and torch.equal(hi, picks[1]))  # the sweeps did move some ranges


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_sweeps_lower_every_rows_output_error(symmetric):
    from qinfer.quantizers.awq import awq_search_clip_gram

    H, W = _correlated_problem(seed=8, N=128)
    scheme = _scheme(4, 32, symmetric)
    errors = {}
    for sweeps in (0, 1, 2):
        lo, hi = awq_search_clip_gram(H, W, scheme, sweeps=sweeps)
        errors[sweeps] = _row_errors(W, fake_quantize(apply_clip(W, lo, hi), scheme), H)
    # a coordinate descent from the per-group picks: no row's error goes up, sweep after sweep
    assert bool((errors[1] <= errors[0] * (1 + 1e-5)).all()) and bool((errors[2] <= errors[1] * (1 + 1e-5)).all())
    # Observed: 0.79 (symmetric) and 0.86 of the per-group picks' total error after two sweeps.
    assert float(errors[2].sum() / errors[0].sum()) < 0.9
    # one group per row (per-channel) has nothing to sweep
    lo, hi = awq_search_clip_gram(H, W, _scheme(4, -1, symmetric), sweeps=2)
    assert all(torch.equal(a, b) for a, b in zip((lo, hi), awq_search_clip_gram(H, W, _scheme(4, -1, symmetric),
                                                                              sweeps=0)))
    for bad in (-1, 1.5, True):
        with pytest.raises(QinferError, match=r"^AWQ clip: sweeps must be an int >= 0"):
            awq_search_clip_gram(H, W, scheme, sweeps=bad)


def test_gram_searches_refuse_weights_the_layout_cannot_hold():
    from qinfer.quantizers.awq import awq_search_clip_gram, awq_search_scales_gram

    scheme = QuantScheme(method="awq", bits=4, group_size=64)
    X = torch.randn(32, 96)
    W = torch.randn(8, 96)  # 96 input channels: groups of 64 do not fit
    with pytest.raises(QinferError, match=r"AWQ weights\[0\]: group_size 64 does not divide in_features K=96"):
        awq_search_scales_gram(X.abs().mean(0), X.T @ X, [W], scheme)
    with pytest.raises(QinferError, match=r"AWQ weights\[0\]: group_size 64 does not divide in_features K=96"):
        awq_search_clip_gram(X.T @ X, W, scheme)
    with pytest.raises(QinferError, match=r"in_features 128 != the Gram matrix's K=96"):
        awq_search_scales_gram(X.abs().mean(0), X.T @ X, [torch.randn(8, 128)], scheme)
