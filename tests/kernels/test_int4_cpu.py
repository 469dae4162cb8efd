"""The CPU int4 kernel against its plain-torch reference and against the format's own dequantization."""

import pytest
import torch

from qinfer.format import QuantScheme
from qinfer.kernels import gemv_cpu, int4_cpu
from qinfer.kernels.linear import linear
from qinfer.kernels.quant_linear import dequant_linear_ref
from qinfer.quantizers.rtn import rtn_quantize

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # relative, per output


def _weight(N, K, group_size, symmetric, seed=0):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    return rtn_quantize(W, QuantScheme(method="rtn", bits=4, group_size=group_size, symmetric=symmetric))


@pytest.mark.parametrize("M", [1, 5, 31])  # under max_rows, whatever the CPU
@pytest.mark.parametrize("N,K", [(48, 256), (272, 640)])
@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, True), (128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_reference(M, N, K, group_size, symmetric, dtype):
    weight = _weight(N, K, group_size, symmetric)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert int4_cpu.supported(x, weight)
    got = int4_cpu.int4_linear(x, weight).float()
    ref = int4_cpu.int4_linear_ref(x.float(), weight).float()
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(err.max()) < TOL[dtype]


def test_kernel_form_equals_the_format_dequantization():
    # (q - 8) * s + (8 - z) * s == (q - z) * s: the reference kernel form is the format's dequantization.
    for symmetric in (True, False):
        weight = _weight(64, 256, 64, symmetric, seed=3)
        x = torch.randn(7, 256, dtype=torch.float64).float()
        torch.testing.assert_close(int4_cpu.int4_linear_ref(x, weight), dequant_linear_ref(x, weight), rtol=1e-5, atol=1e-6)


def test_entry_point_uses_kernel_with_bias_and_leading_dims():
    weight = _weight(32, 128, 32, False)
    x = torch.randn(2, 3, 128)
    bias = torch.randn(32)
    y = linear(x, weight, bias)
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y, dequant_linear_ref(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_long_prefills_take_the_dequantize_then_matmul_path():
    # From max_rows rows on, a GEMM on the dequantized weight in the activations' dtype; below, the kernel. (Where
    # gemv_cpu's loop over tiles takes such batches first, one_row_only gives the path they take without it.)
    weight = _weight(64, 256, 64, False)
    limit = int4_cpu.max_rows(torch.bfloat16)
    for rows, kernel in ((limit - 1, True), (limit, False)):
        x = torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert int4_cpu.supported(x, weight) == kernel
        want = int4_cpu.int4_linear(x, weight) if kernel else dequant_linear_ref(x, weight)
        with gemv_cpu.one_row_only():
            assert torch.equal(linear(x, weight), want)


def test_rows_limit_moves_the_threshold_for_a_side_by_side_timing():
    weight = _weight(64, 256, 64, False)
    x = torch.randn(40, 256).bfloat16()
    with int4_cpu.rows_limit(1 << 30):
        assert int4_cpu.supported(x, weight) and int4_cpu.max_rows(torch.float32) == 1 << 30
    with int4_cpu.rows_limit(0):
        assert not int4_cpu.supported(x[:1], weight)
    assert int4_cpu.max_rows(torch.float32) == int4_cpu.MAX_ROWS_FP32  # restored


def test_unsupported_shapes_fall_back_to_reference():
    W = torch.randn(40, 96) * 0.05  # N not a multiple of 16
    weight = rtn_quantize(W, QuantScheme(method="rtn", bits=4, group_size=32))
    x = torch.randn(3, 96)
    assert not int4_cpu.supported(x, weight)
    torch.testing.assert_close(linear(x, weight), dequant_linear_ref(x, weight))
    three_bit = rtn_quantize(torch.randn(32, 96), QuantScheme(method="rtn", bits=3, group_size=32))
    assert not int4_cpu.supported(x, three_bit)


def test_bias_is_added_before_the_one_rounding():
    # bf16 rows with a bias of the product's size: rounding the product to bf16 and then the sum rounds twice,
    # which parts from the fp32 sum rounded once in over a quarter of the outputs; once, only at near-ties
    weight = _weight(256, 512, 128, False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 512, generator=g).bfloat16()
    bias = (torch.randn(256, generator=g) * 0.3).bfloat16()
    assert int4_cpu.supported(x, weight)
    got = int4_cpu.int4_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    ref = int4_cpu.int4_linear_ref(x, weight, bias)
    assert float((got != ref).float().mean()) < 0.01
