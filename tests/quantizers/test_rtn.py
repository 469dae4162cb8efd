"""RTN is judged by the round-to-nearest bound |w - w_hat| <= scale / 2 and by SNR ordering."""

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import QuantScheme, dequantize_codes
from qinfer.quantizers.rtn import quantize_codes, rtn_params, rtn_quantize


def _weight(N=32, K=256, seed=0):
    # Rows of very different magnitude plus a few outliers, like a real projection.
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, N)[:, None]
    W[torch.randint(0, N, (8,), generator=g), torch.randint(0, K, (8,), generator=g)] *= 20
    return W


def _snr_db(W, W_hat):
    return 10 * torch.log10(W.pow(2).sum() / (W - W_hat).pow(2).sum()).item()


def _rtn(W, **scheme):
    return rtn_quantize(W, QuantScheme(**scheme)).dequantize(torch.float32)


def _per_element_scale(qw):
    K = qw.shape[1]
    G = K if qw.group_size == -1 else qw.group_size
    return qw.scale.float().repeat_interleave(G, dim=1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_error_within_half_a_step(bits, group_size, symmetric):
    W = _weight()
    qw = rtn_quantize(W, QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric))
    err = (W - qw.dequantize(torch.float32)).abs()
    half_step = _per_element_scale(qw) / 2
    # The stored fp16 scale is rounded up, so the bound holds up to float32 rounding of w / scale.
    assert bool((err <= half_step * (1 + 1e-5)).all()), (err / half_step).max()
    assert bool((qw.scale > 0).all()) and bool(torch.isfinite(qw.scale).all())
    if not symmetric:
        assert int(qw.zero.max()) <= (1 << bits) - 1


@pytest.mark.parametrize("symmetric", [True, False])
def test_tiny_weights_keep_the_bound(symmetric):
    # Scales below the fp16 normal range (6e-5) become subnormal; rounding them up keeps them non-zero.
    W = _weight() * 1e-7
    qw = rtn_quantize(W, QuantScheme(bits=4, group_size=32, symmetric=symmetric))
    assert bool((qw.scale > 0).all())
    err = (W - qw.dequantize(torch.float32)).abs()
    assert bool((err <= _per_element_scale(qw) / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_groups(symmetric):
    W = _weight(N=4, K=128)
    W[1, 32:64] = 0.0
    W[3] = 0.0
    qw = rtn_quantize(W, QuantScheme(bits=4, group_size=32, symmetric=symmetric))
    W_hat = qw.dequantize(torch.float32)
    assert bool(torch.isfinite(W_hat).all())
    assert bool((W_hat[1, 32:64] == 0).all()) and bool((W_hat[3] == 0).all())
    # the documented choice for an empty range: the least float16 scale, the middle code as zero point and codes
    assert bool((qw.scale[3] == 2.0**-24).all()) and bool((qw.scale[1, 1] == 2.0**-24))
    assert bool((qw.codes()[3] == 8).all()) and (qw.zero is None or bool((qw.zero[3] == 8).all()))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_snr_grows_with_bits(symmetric, group_size):
    W = _weight()
    bits = (2, 3, 4, 8)
    snr = {b: _snr_db(W, _rtn(W, bits=b, group_size=group_size, symmetric=symmetric)) for b in bits}
    # Every extra bit helps by at least 3 dB (observed 3.4-6.9 dB between 2, 3 and 4 bits, where the
    # clipping of outliers still matters) ...
    for lo, hi in zip(bits, bits[1:]):
        assert snr[hi] - snr[lo] >= 3.0 * (hi - lo), snr
    # ... and at high resolution each bit halves the step: ~6.02 dB per bit (observed 6.0-6.2 from 4 to 8).
    assert snr[8] - snr[4] >= 4 * 5.5, snr


@pytest.mark.parametrize("symmetric", [True, False])
def test_smaller_groups_are_more_accurate(symmetric):
    W = _weight()
    snr = [_snr_db(W, _rtn(W, bits=4, group_size=g, symmetric=symmetric)) for g in (32, 128, -1)]
    assert snr[0] > snr[1] > snr[2], snr


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_codes_inverts_dequantize_on_grid_points(symmetric):
    # The helper GPTQ and AWQ reuse: a weight that lies on the grid comes back as its own code.
    bits, G = 3, 32
    W = _weight(N=8, K=128)
    scale, zero = rtn_params(W, bits, G, symmetric)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 1 << bits, (8, 128), dtype=torch.uint8, generator=g)
    on_grid = dequantize_codes(codes, scale, zero, G)
    assert torch.equal(quantize_codes(on_grid, scale, zero, bits, G), codes)
    if symmetric:
        assert bool((zero == 1 << (bits - 1)).all())


def test_errors_name_the_layer():
    W = torch.randn(8, 96)
    name = "model.layers.3.mlp.down_proj"
    with pytest.raises(QinferError, match=f"{name}: group_size 64 does not divide in_features K=96"):
        rtn_quantize(W, QuantScheme(group_size=64), name=name)
    with pytest.raises(QinferError, match="lm_head: K=6 codes of 3 bits"):
        rtn_quantize(torch.randn(4, 6), QuantScheme(bits=3, group_size=-1), name="lm_head")
    W[0, 0] = float("nan")
    with pytest.raises(QinferError, match="q_proj: weight contains NaN or Inf"):
        rtn_quantize(W, QuantScheme(group_size=32), name="q_proj")
    with pytest.raises(QinferError, match="too large for a float16 scale .*: .*check the checkpoint"):
        rtn_quantize(torch.full((2, 32), 1e6), QuantScheme(group_size=32))
    with pytest.raises(QinferError, match="integer scheme"):
        rtn_quantize(torch.randn(2, 32), QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1))


def _group_error(W, qw, group_size, norm=2.4):
    err = (W - qw.dequantize(torch.float32)).abs().pow(norm)
    G = W.shape[1] if group_size == -1 else group_size
    return err.reshape(W.shape[0], -1, G).sum(-1)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_never_loses_to_min_max(bits, group_size, symmetric):
    # Shrink factor 1 is among the candidates, so every group's |w - w_hat|^2.4 can only go down, and with
    # outliers in the weight some groups must shrink (smaller scale) and gain.
    W = _weight()
    plain = rtn_quantize(W, QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric))
    clipped = rtn_quantize(W, QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, mse_clip=True))
    e_plain, e_clip = _group_error(W, plain, group_size), _group_error(W, clipped, group_size)
    assert bool((e_clip <= e_plain * (1 + 1e-3) + 1e-12).all())
    assert e_clip.sum() < 0.97 * e_plain.sum()
    assert bool((clipped.scale <= plain.scale).all()) and bool((clipped.scale < plain.scale).any())
    if symmetric:
        assert clipped.zero is None
    # The codes are still round to nearest on the stored grid.
    zero = 1 << (bits - 1) if symmetric else clipped.zero
    assert torch.equal(clipped.codes(), quantize_codes(W, clipped.scale, zero if not symmetric else
                                                       torch.full_like(clipped.scale, zero, dtype=torch.uint8),
                                                       bits, group_size))


def _brute_force_errors(x, lo, hi, maxq, symmetric):
    """|w - w_hat|^2.4 summed per group for each of the 80 shrink factors, one factor at a time, with pow."""
    errs = []
    for i in range(80):
        p = 1 - i / 100
        scale = ((hi - lo) * p / maxq).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
        zero = torch.full_like(scale, (maxq + 1) // 2) if symmetric else torch.round(-lo * p / scale[..., 0])[..., None]
        q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
        errs.append(((q - zero) * scale - x).abs().pow(2.4).sum(-1))
    return torch.stack(errs)  # [80, N, groups]


@pytest.mark.parametrize("rows", [4, 2048])  # many shrink factors per step, and one (x as large as the budget)
@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_matches_a_brute_force_over_every_group(rows, symmetric):
    from qinfer.quantizers.rtn import _CANDIDATE_BUDGET, _best_shrink

    x = _weight(N=rows, K=128, seed=rows).reshape(rows, 2, 64)
    factors_per_op = max(1, _CANDIDATE_BUDGET // x.numel())
    assert factors_per_op == (1 if rows == 2048 else 512)
    x[0, 0] = 0.0  # an all-zero group: every factor ties at error 0, and the search keeps 1
    hi = x.abs().amax(-1) if symmetric else x.amax(-1).clamp(min=0.0)
    lo = -hi if symmetric else x.amin(-1).clamp(max=0.0)
    shrink = _best_shrink(x, lo, hi, 15, symmetric)
    errs = _brute_force_errors(x, lo, hi, 15, symmetric)
    picked = errs.gather(0, torch.round((1 - shrink) * 100).long()[None])[0]
    # The search sums in grid steps with exp(2.4 log |r|), which differs from pow in the last bits: a near-tie may
    # go either way, but the factor picked is never worse than the best by more than that.
    assert torch.allclose(picked, errs.amin(0), rtol=1e-5, atol=0)
    assert shrink[0, 0] == 1.0
    assert bool((shrink < 1).sum() > rows // 2)  # outliers and Gaussian tails: most groups clip


def test_clip_search_picks_the_best_shrink_of_a_single_group():
    # One group through rtn_params: its stored scale is the brute force's best shrink of the min/max range.
    torch.manual_seed(0)
    x = torch.randn(1, 64)
    x[0, 3] = 9.0
    scale, _ = rtn_params(x, 4, -1, False, mse=True)
    lo, hi = x.min().reshape(1, 1), x.max().reshape(1, 1)
    best = 1 - _brute_force_errors(x.reshape(1, 1, 64), lo, hi, 15, False)[:, 0, 0].argmin().item() / 100
    assert scale.float().item() == pytest.approx((hi - lo).item() * best / 15, rel=1e-3)
    assert best < 0.99
