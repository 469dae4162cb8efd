"""The CPU one-row FP8 path against exact products and against the dequantize-then-matmul reference."""

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import FP8_SHIFT, Fp8Weight, QuantScheme, e4m3_as_fp16
from qinfer.kernels import cpu_library, fp8_cpu
from qinfer.kernels.linear import linear
from qinfer.kernels.quant_linear import dequant_linear_ref
from qinfer.quantizers.fp8 import fp8_quantize


def _weight(N, K, granularity="channel", seed=0):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    W[:, :7] *= 1e-4  # codes down among E4M3's subnormals
    return fp8_quantize(W, QuantScheme(method="fp8", bits=8, format="fp8", group_size=-1, fp8_granularity=granularity))


def _exact(x: torch.Tensor, weight: Fp8Weight, bias=None) -> torch.Tensor:
    y = x.double() @ (weight.weight.double() * weight.scale.double()).T
    return y if bias is None else y + bias.double()


def test_every_finite_code_moves_to_fp16_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes.float().isfinite()  # E4M3 has no inf; its two NaN codes are never written
    weight = Fp8Weight(codes[finite].reshape(2, -1), torch.ones(2, 1))
    assert torch.equal(e4m3_as_fp16(weight.weight).float() * FP8_SHIFT, weight.weight.float())
    assert int((weight.weight.float().abs() < 2.0**-6).sum()) == 16  # the subnormals (and zeros) were in it
    # the format's dequantize goes through the same bit move: equal, bit for bit, to weight.float() * scale
    g = torch.Generator().manual_seed(0)
    for scale in (torch.rand(2, 1, generator=g) * 1e-3, torch.rand(1, generator=g) * 7):
        w = Fp8Weight(weight.weight, scale)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(w.dequantize(dtype), (w.weight.float() * scale).to(dtype))
            assert torch.equal(w.rows(torch.tensor([1, 0, 1]), dtype), (w.weight.float() * scale).to(dtype)[[1, 0, 1]])


def test_a_stored_weight_with_nan_codes_is_refused():
    scheme = QuantScheme(method="fp8", bits=8, format="fp8", group_size=-1)
    weight = _weight(16, 32)
    codes = weight.weight.view(torch.uint8).clone()
    codes[3, 5] = 0xFF  # -NaN
    entries = {"p.weight": codes.view(torch.float8_e4m3fn), "p.scale": weight.scale}
    with pytest.raises(QinferError, match="p.weight holds NaN codes"):
        Fp8Weight.from_tensors("p", entries, scheme)
    assert Fp8Weight.from_tensors("p", {"p.weight": weight.weight, "p.scale": weight.scale}, scheme).shape == (16, 32)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float16, 2e-3)])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_one_row_matches_the_exact_product(dtype, tol, granularity):
    weight = _weight(272, 640, granularity)
    bias = torch.randn(272)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert fp8_cpu.supported(x, weight)
    got = fp8_cpu.fp8_linear(x, weight, bias.to(dtype))
    exact = _exact(x, weight, bias.to(dtype))
    assert got.dtype == dtype and got.shape == (1, 272)
    err = float((got.double() - exact).abs().max() / exact.abs().max())
    assert err < tol
    ref = float((dequant_linear_ref(x, weight, bias.to(dtype)).double() - exact).abs().max() / exact.abs().max())
    assert err <= ref * 1.5  # no worse than the reference (which rounds every dequantized weight first)


def test_rows_far_outside_fp16_range():
    # the row is normalised before its fp16 rounding: activations of 1e6 (fp16 holds 65504) stay finite and exact
    weight = _weight(64, 2048, seed=2)
    x = torch.randn(1, 1, 2048) * 1e6
    x[..., 5] = 3e7
    x = x.bfloat16()
    got = linear(x, weight)
    assert got.shape == (1, 1, 64) and bool(got.isfinite().all())
    exact = _exact(x.reshape(1, -1), weight)
    assert float((got.reshape(1, -1).double() - exact).norm() / exact.norm()) < 8e-3
    zeros = torch.zeros(1, 2048, dtype=torch.bfloat16)
    assert torch.equal(linear(zeros, weight), torch.zeros(1, 64, dtype=torch.bfloat16))


def test_dispatch_one_row_fast_many_rows_reference():
    # (with the C kernels built, one row goes to gemv_cpu's instead: tests/kernels/test_gemv_cpu.py)
    weight = _weight(48, 256, seed=3)
    row, rows = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(5, 256, dtype=torch.bfloat16)
    assert fp8_cpu.supported(row, weight) and not fp8_cpu.supported(rows, weight)
    assert not fp8_cpu.supported(row.float(), weight)  # fp32 rows keep the reference's fp32 product
    with cpu_library.disabled():
        assert torch.equal(linear(row, weight), fp8_cpu.fp8_linear(row, weight))
        assert torch.equal(linear(rows, weight), dequant_linear_ref(rows, weight))
        assert torch.equal(linear(row.float(), weight), dequant_linear_ref(row.float(), weight))
    long_rows = Fp8Weight(torch.zeros(1, fp8_cpu.MAX_K + 1, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    assert not fp8_cpu.supported(torch.randn(1, fp8_cpu.MAX_K + 1, dtype=torch.bfloat16), long_rows)  # its outputs could overflow fp16


def test_compiled_one_row_keeps_the_fp16_move_as_one_operator():
    # under torch.compile the move into fp16 is one opaque operator (inductor would fuse its integer passes into
    # a scalar loop); the traced graph calls it instead of the passes, and gives the eager result bit for bit
    weight = _weight(96, 320, seed=4)
    x, bias = torch.randn(1, 1, 320, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    # (opcheck's schema test multiplies every tensor argument, which torch cannot do for float8 ones)
    torch.library.opcheck(fp8_cpu.codes_as_fp16, (weight.weight,), test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(fp8_cpu.codes_as_fp16(weight.weight), e4m3_as_fp16(weight.weight))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fp8_cpu.fp8_linear, backend=backend, fullgraph=True)
    got = compiled(x, weight, bias)
    assert torch.equal(got, fp8_cpu.fp8_linear(x, weight, bias)) and got.shape == (1, 1, 96)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert "qinfer.e4m3_as_fp16" in targets and not any("shift" in t for t in targets), targets
