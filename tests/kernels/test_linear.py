"""The linear entry point: every weight form, and no copy of the weight for strided inputs."""


import pytest
import torch

from qinfer.format import QuantScheme
from qinfer.kernels import cpu_library, dense, gemv_cpu, int4_cpu
from qinfer.kernels.linear import linear, matmul_dtype
from qinfer.quantizers.rtn import rtn_quantize



def test_last_position_of_a_prefill_does_not_copy_the_weight():
    # h[:, -1:] of [1, T, K] keeps the batch stride T * K: torch.matmul did not fold it, broadcast the weight
    # into a [1, K, N] batch and bmm copied that to contiguous memory (in bf16), the lm_head's at every prefill
    N, K = 4096, 64
    weight = torch.randn(N, K, dtype=torch.bfloat16)
    x = torch.randn(1, 33, K, dtype=torch.bfloat16)[:, -1:]
    with torch.profiler.profile(profile_memory=True) as prof:
        y = linear(x, weight)
    largest = max(e.cpu_memory_usage for e in prof.events())  # bytes, the largest allocation of any op
    assert 0 < largest < weight.numel() * weight.element_size()
    assert y.shape == (1, 1, N)
    torch.testing.assert_close(y.float(), x.float() @ weight.float().T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 64), (2, 3, 4, 64), (0, 64)])
def test_leading_dimensions_are_kept(shape):
    weight, bias = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(shape)
    torch.testing.assert_close(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))


def test_packed_weights_take_strided_inputs():
    weight = torch.randn(64, 128)
    packed = rtn_quantize(weight, QuantScheme(method="rtn", bits=4, group_size=32))
    h = torch.randn(2, 9, 128)
    x = h[:, 2:7:2]  # strided in the token dimension
    torch.testing.assert_close(linear(x, packed), linear(x.contiguous(), packed))
    torch.testing.assert_close(linear(x, packed), x @ packed.dequantize(torch.float32).T, rtol=1e-4, atol=1e-4)


def _onednn_runs(capfd, fn) -> bool:
    """Whether ``fn()`` executes a oneDNN primitive (from oneDNN's verbose log on stdout)."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()
    return "primitive,exec" in capfd.readouterr().out


def test_one_bf16_row_bypasses_onednn(capfd):
    # oneDNN's bf16 matmul streams a weight at less than half the speed of ATen's GEMV for a single row
    weight = torch.randn(512, 64, dtype=torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    if not _onednn_runs(capfd, lambda: torch.nn.functional.linear(x, weight)):
        pytest.skip("torch does not run bf16 matmuls through oneDNN on this CPU")
    assert not _onednn_runs(capfd, lambda: linear(x, weight))
    many = torch.randn(gemv_cpu.bf16_rows_max() + 1, 64, dtype=torch.bfloat16)
    assert _onednn_runs(capfd, lambda: linear(many, weight))  # past the C kernel's rows: oneDNN
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x, weight), rtol=1e-2, atol=1e-2)
    assert torch.backends.mkldnn.enabled


def test_onednn_switch_is_restored_after_an_error():
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(512, 63, dtype=torch.bfloat16))
    assert torch.backends.mkldnn.enabled


@pytest.fixture
def no_native_half(monkeypatch):
    """A CPU whose oneDNN takes no bf16/fp16 GEMMs (AVX2 only, so no AVX512-BF16 loop either), whatever this one is."""
    monkeypatch.setattr(dense, "native_half_gemm", lambda dtype: dtype not in (torch.bfloat16, torch.float16))
    with cpu_library.bf16_without_dot():
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_without_native_half_gemms_rows_multiply_in_fp32(no_native_half, monkeypatch, dtype):
    monkeypatch.setattr(dense, "_WIDEN_CHUNK", 5 * 64)  # 5 weight rows widened at a time: 4 slices
    x, weight, bias = torch.randn(3, 8, 64, dtype=dtype), torch.randn(18, 64, dtype=dtype), torch.randn(18, dtype=dtype)
    y = linear(x, weight, bias)
    assert y.dtype == dtype and y.shape == (3, 8, 18)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype)
    assert torch.equal(y, expected)  # every slice, and the bias, in fp32, rounded once


def test_without_native_half_gemms_few_rows_keep_the_half_product(no_native_half):
    x, weight = torch.randn(7, 64, dtype=torch.bfloat16), torch.randn(18, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight), torch.nn.functional.linear(x, weight))
    cpu = torch.device("cpu")
    assert matmul_dtype(weight, torch.bfloat16, cpu, 7) == torch.bfloat16
    assert matmul_dtype(weight, torch.bfloat16, cpu, 8) == torch.float32
    assert matmul_dtype(weight.float(), torch.float32, cpu, 512) == torch.float32


def test_without_native_half_gemms_a_long_prefill_dequantizes_into_an_fp32_product(no_native_half):
    # from int4_cpu.max_rows rows on (MAX_ROWS_FP32 on such a CPU) a 4-bit weight is dequantized and goes to
    # the dense product, which there runs in fp32 (and MFU holds those FLOPs to the fp32 peak)
    packed = rtn_quantize(torch.randn(32, 128), QuantScheme(method="rtn", bits=4, group_size=32))
    rows = int4_cpu.max_rows(torch.bfloat16)
    assert rows == int4_cpu.MAX_ROWS_FP32
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), packed.dequantize(torch.bfloat16).float()).bfloat16()
    assert torch.equal(linear(x, packed), expected)
    assert matmul_dtype(packed, torch.bfloat16, torch.device("cpu"), rows) == torch.float32
    assert matmul_dtype(packed, torch.bfloat16, torch.device("cpu"), rows - 1) == torch.float32  # the kernel's
