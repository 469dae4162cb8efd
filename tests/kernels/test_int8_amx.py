"""The AMX-INT8 loop for 8-bit codes against the AVX512-VNNI loop over tiles: the same outputs bit for bit (both sum
each group's integers exactly and turn them into fp32 by the same operations), for every M and shape the tiles take."""

import pytest
import torch

from qinfer.kernels import cpu_library, gemv_cpu
from tests.kernels.test_gemv_cpu import _int
from tests.kernels.test_gemv_rows import _bias, _rows, _same_as_alone

needs_amx8 = pytest.mark.skipif("AMX-INT8" not in cpu_library.int8_loops(),
                                reason="no AMX-INT8 loop here: the CPU lacks AMX-TILE/AMX-INT8 or AVX512-VNNI, the "
                                       "compiler or OS does not allow the tiles, or the C kernels are not built")


def _both(x, weight, bias):
    with cpu_library.with_int8_loop("AMX-INT8 at every M"):
        amx = gemv_cpu.int_gemv(x, weight, bias)
    with cpu_library.int8_without_amx():
        vnni = gemv_cpu.int_gemv(x, weight, bias)
    return amx, vnni


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16)


@needs_amx8
@pytest.mark.parametrize("N", [1, 15, 17, 100])  # output tiles of 16 and pairs of them, in part
@pytest.mark.parametrize("K,G", [(16, -1), (48, -1), (96, 32), (144, -1), (192, 64), (400, -1), (640, 128),
                                 (512, -1)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_int8_outputs_are_the_vnni_loops_bits(N, K, G, symmetric, dtype):
    # groups (per channel: G = K) whose last 64-column chunk is partial (16, 32, 48, 80, 144, 400) or whole (64, 128,
    # 512); every M from 1 to 64 (blocks of 16 rows of x, whole and in part); a bias for odd M
    weight = _int(N, K, G, symmetric, seed=N + K, bits=8)
    x = _rows(64, K, dtype, seed=K)
    assert gemv_cpu._tiled(dtype, K if G == -1 else G, 8)
    for M in range(1, 65):
        bias = _bias(N, dtype, M % 2 == 1)
        amx, vnni = _both(x[:M], weight, bias)
        assert torch.equal(_bits(amx), _bits(vnni)), M


@needs_amx8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_int8_a_nan_row_takes_the_float_loop_and_the_others_keep_their_bits(dtype):
    weight = _int(40, 640, 128, False, bits=8)
    x = _rows(33, 640, dtype, seed=3)
    clean = x.clone()
    x[2, 7], x[32, 0] = float("nan"), float("inf")
    others = [m for m in range(33) if m not in (2, 32)]
    amx, vnni = _both(x, weight, None)
    assert torch.equal(_bits(amx), _bits(vnni))
    assert torch.isnan(amx[2]).all() and not torch.isfinite(amx[32]).any() and torch.isfinite(amx[others]).all()
    with cpu_library.with_int8_loop("AMX-INT8 at every M"):
        _same_as_alone(gemv_cpu.int_gemv, x, weight)
        assert torch.equal(_bits(gemv_cpu.int_gemv(clean, weight)[others]), _bits(amx[others]))


@needs_amx8
def test_amx_int8_rows_keep_their_bits_in_any_batch():
    weight = _int(1000, 640, 128, False, bits=8)
    x = _rows(64, 640, torch.bfloat16, seed=5)
    with cpu_library.with_int8_loop("AMX-INT8 at every M"):
        full = _same_as_alone(gemv_cpu.int_gemv, x, weight)
        for lo, hi in [(0, 1), (40, 41), (3, 20), (0, 16), (17, 50), (30, 64)]:
            assert torch.equal(_bits(gemv_cpu.int_gemv(x[lo:hi], weight)), _bits(full[lo:hi]))


@needs_amx8
def test_8bit_codes_take_the_amx_loop_first_and_the_switch_chooses():
    assert cpu_library.int8_loops() == ["AMX-INT8 at every M", "AMX-INT8"]
    assert cpu_library.int8_loop() == "AMX-INT8" and "8-bit codes through AMX-INT8" in cpu_library.describe()
    with cpu_library.int8_without_amx():
        assert cpu_library.int8_loop() == "" and "8-bit codes" not in cpu_library.describe()
        assert gemv_cpu._tiled(torch.bfloat16, 128, 8)  # the VNNI loop over the same tiles
    assert cpu_library.int8_loop() == "AMX-INT8"


@pytest.mark.skipif(not cpu_library.available(), reason="no C kernels here")
def test_an_int8_loop_the_cpu_lacks_is_refused():
    with pytest.raises(ValueError, match="this CPU has no nonsense loop"):
        cpu_library.with_int8_loop("nonsense")


@needs_amx8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_int8_outputs_round_as_the_vnni_loops_a_nan_and_infinities_in_the_bias_too(dtype):
    # the outputs of whole tiles of 16 are rounded 16 at a time, those of the last tile in part one by one
    weight = _int(37, 640, 128, False, bits=8)
    x = _rows(20, 640, dtype, seed=7)
    bias = _bias(37, dtype, True)
    bias[[1, 18, 36]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    bias[3] = torch.finfo(dtype).max
    amx, vnni = _both(x, weight, bias)
    assert torch.equal(_bits(amx), _bits(vnni))
    assert torch.isnan(amx[:, 1]).all() and torch.isnan(amx[:, 18]).logical_not().all()
