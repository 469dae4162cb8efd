"""The CPU one-row int8 path (bit widths the int4 kernel does not take) against exact products."""

import contextlib
import dataclasses

import pytest
import torch

from qinfer.format import QuantScheme, pack
from qinfer.kernels import cpu_library, gemv_cpu, int4_cpu, int8_cpu
from qinfer.kernels.linear import linear
from qinfer.kernels.quant_linear import dequant_linear_ref
from qinfer.quantizers.rtn import rtn_quantize


def _weight(N, K, bits, group_size, symmetric, seed=0):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    W[: N // 2] += 0.03  # rows whose groups sit off zero: the zero points matter
    scheme = QuantScheme(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric)
    return rtn_quantize(W, scheme)


def _exact(x, weight, bias=None):
    y = x.double() @ weight.dequantize(torch.float64).T  # the format's own dequantization, in float64
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_one_row_matches_the_exact_product(bits, group_size, symmetric):
    weight = _weight(72, 256, bits, group_size, symmetric)
    bias = torch.randn(72).bfloat16()
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert int8_cpu.supported(x, weight)
    got = int8_cpu.int8_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 72)
    exact = _exact(x, weight, bias)
    err = float((got.double() - exact).norm() / exact.norm())
    ref = float((dequant_linear_ref(x, weight, bias).double() - exact).norm() / exact.norm())
    assert err < 4e-3 and err <= 2 * ref + 1e-3  # bf16 roundings, like the reference's


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("c_kernels", [True, False])
def test_a_per_channel_k_off_the_16_grid_is_multiplied_right(bits, c_kernels):
    # PyTorch's int8 weight-only kernel (AVX-512) returns garbage for such a K: no path may hand it one
    if c_kernels and not cpu_library.available():
        pytest.skip(f"no C GEMV here: {cpu_library.unavailable_reason()}")
    weight = _weight(40, 1000, bits, -1, True)
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert not int8_cpu.supported(x, weight)
    with contextlib.nullcontext() if c_kernels else cpu_library.disabled():
        got = linear(x, weight)
    exact = _exact(x, weight)
    assert float((got.double() - exact).norm() / exact.norm()) < 4e-3


@pytest.mark.parametrize("c_kernels", [True, False])
def test_dispatch(c_kernels):
    # one bf16 row: the C kernels for 4 and 8 bits where built (gemv_cpu); else the int4 kernel for grouped
    # 4-bit, the int8 path for other widths; everything else the reference
    if c_kernels and not cpu_library.available():
        pytest.skip(f"no C GEMV here: {cpu_library.unavailable_reason()}")
    w8, w4 = _weight(64, 256, 8, 128, False), _weight(64, 256, 4, 128, False)
    w4_channel = _weight(64, 256, 4, -1, False)
    row = torch.randn(1, 1, 256).bfloat16()
    with contextlib.nullcontext() if c_kernels else cpu_library.disabled():
        one_row = gemv_cpu.int_gemv if c_kernels else int8_cpu.int8_linear
        assert torch.equal(linear(row, w8), one_row(row, w8))
        assert torch.equal(linear(row, w4), (gemv_cpu.int_gemv if c_kernels else int4_cpu.int4_linear)(row, w4))
        assert not int4_cpu.supported(row, w4_channel)
        assert torch.equal(linear(row, w4_channel), one_row(row, w4_channel))
        # past the C kernels' rows (8-bit groups of 128: the loop over tiles' where AVX512-VNNI runs): the reference
        tiles = c_kernels and cpu_library.int4_vnni() == "AVX512-VNNI"
        many = torch.randn(gemv_cpu.ROWS_MAX["int4" if tiles else "int"] + 1, 256).bfloat16()
        assert not int8_cpu.supported(many, w8) and not gemv_cpu.int_supported(many, w8)
        assert torch.equal(linear(many, w8), dequant_linear_ref(many, w8))
    fp32_row = torch.randn(1, 256)
    assert not int8_cpu.supported(fp32_row, w8)
    with cpu_library.disabled():
        assert torch.equal(linear(fp32_row, w8), dequant_linear_ref(fp32_row, w8))


@pytest.mark.parametrize("bits,rows", [(4, 1), (4, 5), (8, 1), (3, 1), (3, 4)])
def test_permuted_columns_multiply_the_permuted_input(bits, rows):
    # an imported act-order weight stores its columns in group order (format: perm); every path (int4 kernel,
    # int8 path, reference) must compute x @ W^T with W in input-channel order
    weight = _weight(64, 256, bits, 32, False)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    permuted = dataclasses.replace(weight, perm=perm)
    W = permuted.dequantize(torch.float64)
    assert torch.equal(W[:, perm.long()], weight.dequantize(torch.float64))  # stored column j is channel perm[j]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = x.double() @ W.T
    got = linear(x, permuted)
    assert float((got.double() - exact).norm() / exact.norm()) < 4e-3
    ref = linear(x, weight)  # the same codes without the permutation are a different product
    assert float((ref.double() - exact).norm() / exact.norm()) > 0.5


def test_converted_codes_are_cached_per_weight_and_released():
    weight = _weight(32, 64, 3, 32, True)
    row = torch.randn(1, 64).bfloat16()
    int8_cpu.int8_linear(row, weight)
    key = id(weight)
    blocks = int8_cpu._BLOCKS[key][0]
    assert [tuple(b.shape) for b in blocks] == [(32, 32), (32, 32)] and blocks[0].dtype == torch.int8
    int8_cpu.int8_linear(row, weight)
    assert int8_cpu._BLOCKS[key][0] is blocks  # converted once
    del weight
    assert key not in int8_cpu._BLOCKS


def _with_empty_rows(bits, symmetric, old_style=False):
    """A weight whose row 0 is all zeros and row 1 has one all-zero group; ``old_style``: those groups stored as
    quantizers before the middle zero point stored them (zero point 0, codes 0, scale 1)."""
    W = torch.randn(48, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    W[0], W[1, 32:64] = 0.0, 0.0
    weight = rtn_quantize(W, QuantScheme(method="rtn", bits=bits, group_size=32, symmetric=symmetric))
    if not old_style:
        return weight
    codes, scale, zero = weight.codes(), weight.scale.clone(), weight.zero.clone()
    for row, groups in ((0, slice(None)), (1, slice(1, 2))):
        scale[row, groups], zero[row, groups] = 1.0, 0
    codes[0], codes[1, 32:64] = 0, 0
    return dataclasses.replace(weight, qweight=pack(codes, bits), scale=scale, zero=zero)


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("symmetric, old_style", [(True, False), (False, False), (False, True)])
def test_all_zero_groups_contribute_nothing(bits, symmetric, old_style):
    # a zero row (a padding token's embedding under --quantize-lm-head) gives 0, not a bf16 rounding of a product
    # the zero term cancels: with a scale of 1 that rounding was larger than the other rows' outputs
    weight = _with_empty_rows(bits, symmetric, old_style)
    assert bool((weight.dequantize(torch.float32)[0] == 0).all())
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)).bfloat16() + 1.0  # a mean: sum(x) far from 0
    got = int8_cpu.int8_linear(x, weight).float()[0]
    exact = _exact(x, weight)[0]
    assert got[0] == 0.0
    assert float((got[1] - exact[1]).abs()) <= 1e-2 * float(exact.abs().max())
    if cpu_library.available() and not old_style:  # the C GEMV reads the stored bytes: the quantizer's choice matters
        c = gemv_cpu.int_gemv(x, weight).float()[0]
        assert float(c[0].abs()) <= 1e-4 * float(exact.abs().max())


def test_a_strided_row_is_read_as_its_values():
    weight = _weight(16, 256, 8, 32, False)
    wide = torch.randn(1, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    row = wide[:, ::2]  # every other value: a view whose last dimension is not contiguous
    assert torch.equal(int8_cpu.int8_linear(row, weight), int8_cpu.int8_linear(row.contiguous(), weight))
