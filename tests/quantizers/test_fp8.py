"""FP8 (E4M3) is judged by its rounding bound, saturation and the KV-scale formulas."""

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import FP8_MAX, QuantScheme
from qinfer.quantizers.fp8 import fp8_cast, fp8_kv_scale, fp8_quantize, int8_kv_scale


def _scheme(granularity="channel"):
    return QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity=granularity)


def _weight(N=32, K=200, seed=0):
    # Magnitudes log-uniform over six decades with random signs, and row maxima spread over three.
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (torch.rand(N, K, generator=g) * 6 - 4)
    sign = torch.where(torch.rand(N, K, generator=g) < 0.5, -1.0, 1.0)
    return sign * mag * torch.logspace(-2, 1, N)[:, None]


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_error_within_the_e4m3_rounding_bound(granularity):
    # 3 mantissa bits: half an ulp is <= 2^-4 of the value in the normal range (|w / scale| >= 2^-6);
    # below it the subnormal step is 2^-9, so the absolute error is <= 2^-10 * scale.
    W = _weight()
    fw = fp8_quantize(W, _scheme(granularity))
    err = (W - fw.dequantize(torch.float32)).abs()
    bound = torch.maximum(W.abs() * 2**-4, fw.scale * 2**-10)
    assert bool((err <= bound * (1 + 1e-6)).all()), (err / bound).max()
    # and the bound is tight, not vacuous: some normal-range element loses close to 2^-4 of itself
    normal = W.abs() >= fw.scale * 2**-6
    assert (err[normal] / W.abs()[normal]).max() > 0.9 * 2**-4


def test_row_absmax_maps_to_448_per_channel():
    W = _weight()
    fw = fp8_quantize(W, _scheme("channel"))
    assert fw.scale.shape == (32, 1) and fw.scale.dtype == torch.float32
    assert torch.equal(fw.weight.float().abs().amax(dim=1), torch.full((32,), FP8_MAX))
    assert bool(torch.isfinite(fw.weight.float()).all())


def test_per_channel_beats_per_tensor_on_small_rows():
    # One shared scale pushes rows 1e5 times smaller than the rest into the subnormals (|x| < 2^-6) and
    # mostly to zero; per-channel scales keep them at the normal-range accuracy.
    W = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    W[:8] *= 1e-5
    rel = {}
    for gran in ("channel", "tensor"):
        W_hat = fp8_quantize(W, _scheme(gran)).dequantize(torch.float32)
        rel[gran] = ((W - W_hat).norm(dim=1) / W.norm(dim=1))[:8].max().item()
    assert fp8_quantize(W, _scheme("tensor")).scale.shape == (1,)
    assert rel["channel"] <= 2**-4 and rel["tensor"] >= 0.25, rel


def test_saturates_instead_of_nan():
    x = torch.tensor([1000.0, -1e6, 448.5, 447.0, -3.0])
    got = fp8_cast(x, torch.tensor(1.0)).float()
    assert torch.equal(got, torch.tensor([448.0, -448.0, 448.0, 448.0, -3.0]))


def test_zero_rows_and_bad_input():
    W = _weight(N=4, K=16)
    W[2] = 0.0
    fw = fp8_quantize(W, _scheme())
    assert fw.scale[2].item() == 1.0
    assert bool((fw.dequantize(torch.float32)[2] == 0).all())
    W[0, 0] = float("inf")
    with pytest.raises(QinferError, match="o_proj: weight contains NaN or Inf"):
        fp8_quantize(W, _scheme(), name="o_proj")
    with pytest.raises(QinferError, match="fp8 scheme"):
        fp8_quantize(torch.randn(4, 16), QuantScheme())


def test_a_row_of_fp32_subnormals_gets_a_positive_scale_not_nan_codes():
    W = _weight(N=2, K=16)
    W[0] = torch.tensor([1e-44, 0.0, -1e-45] * 5 + [0.0])  # absmax / 448 underflows float32 to 0
    fw = fp8_quantize(W, _scheme())
    assert bool((fw.scale > 0).all()) and not fw.dequantize(torch.float32).isnan().any()
    assert fw.dequantize(torch.float32)[0].abs().max() <= 1e-44
    assert bool((fp8_kv_scale(torch.tensor([1e-44, 0.0])) > 0).all())
    assert bool((int8_kv_scale(torch.tensor([1e-44])) > 0).all())


def test_kv_scales():
    absmax = torch.tensor([448.0, 0.0, 4.48, 127.0])
    assert torch.allclose(fp8_kv_scale(absmax), torch.tensor([1.0, 1.0, 0.01, 127.0 / 448.0]))
    assert torch.allclose(int8_kv_scale(absmax), torch.tensor([448.0 / 127.0, 1.0, 4.48 / 127.0, 1.0]))
    assert fp8_kv_scale(absmax.half()).dtype == torch.float32
    # a head's absmax lands exactly on the top of the range
    k = torch.tensor([-4.48, 2.0, 4.48])
    assert fp8_cast(k, fp8_kv_scale(torch.tensor([4.48]))).float().abs().max().item() == FP8_MAX
    with pytest.raises(QinferError, match="negative"):
        int8_kv_scale(torch.tensor([1.0, -1.0]))
    with pytest.raises(QinferError, match="NaN or Inf"):
        fp8_kv_scale(torch.tensor([float("nan")]))
    with pytest.raises(QinferError, match=r"^model\.layers\.2\.self_attn\.v_proj: output range contains NaN .*overflow"):
        int8_kv_scale(torch.tensor([1.0, float("inf")]), "model.layers.2.self_attn.v_proj: output range")
