"""The C GEMVs on M rows at once: each row's output has the bits of that row alone (batch invariance), and the
reference's numbers within the one-row tests' bounds."""

import pytest
import torch

from qinfer.format import Fp8Weight, QuantizedWeight, unpack
from qinfer.kernels import cpu_library, gemv_cpu
from qinfer.kernels.linear import linear
from qinfer.kernels.quant_linear import dequant_linear_ref
from tests.kernels.test_gemv_cpu import _bf16_loops, _check, _fixed_point_error, _fp8, _int, _int4_loops, needs_kernels

ROWS = [1, 2, 3, 5, 7, 8, 16, 33, 64]  # the 4-bit tiles' blocks of 8 rows and the bf16 passes of 3, whole and in part


def _rows(M: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[:, 5] *= 40  # outliers, as in the one-row tests: they set the VNNI loop's steps
    x[::3, :] *= 2.0**-5  # rows of other magnitudes beside them: each row's fixed point is its own
    return x


def _same_as_alone(gemv, x: torch.Tensor, *args) -> torch.Tensor:
    # the M-row call, and each row's equality with its one-row call, bit for bit (NaNs and zeros' signs too)
    got = gemv(x, *args)
    assert got.shape == (*x.shape[:-1], got.shape[-1])
    flat = got.reshape(-1, got.shape[-1])
    alone = torch.cat([gemv(row[None], *args) for row in x.reshape(-1, x.shape[-1])])
    bits = torch.int32 if flat.element_size() == 4 else torch.int16
    assert torch.equal(flat.view(bits), alone.view(bits))
    return got


def _bias(N: int, dtype: torch.dtype, with_bias: bool) -> torch.Tensor | None:
    return torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype) if with_bias else None


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    b = 0.0 if bias is None else bias.double()
    magnitude = x.double().abs() @ w.abs().T + (0.0 if bias is None else bias.double().abs())
    return x.double() @ w.T + b, magnitude


def _factored(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The size of the two terms the integer loops sum per group, s (sum q x - z sum x), [M, N]: their fp32 error
    scales with these (where the zero term cancels most of sum q x, more than with sum |w x|)."""
    (N, K), bits = weight.shape, weight.bits
    G = K if weight.group_size == -1 else weight.group_size
    q = unpack(weight.qweight, bits, K).double().reshape(N, K // G, G)
    s = weight.scale.double().abs()
    z = torch.full_like(s, 2 ** (bits - 1)) if weight.zero is None else weight.zero.double()
    xg = x.double().reshape(-1, K // G, G)
    qx = (xg.abs()[:, None] * q[None]).sum(-1)  # [M, N, K/G]
    return ((qx + z[None] * xg.sum(-1).abs()[:, None]) * s[None]).sum(-1)


@needs_kernels
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K", [32, 77, 640, 2100])  # whole and masked parts of 32; tiles of 1024 columns and a part one
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_rows_are_each_row_alone(M, K, with_bias):
    # 37 outputs: 4 blocks of 8 (the AVX512-BF16 loop's) and 5 of a padded one; 37 groups of 32 at K = 640 are 2
    # groups of 4 blocks split over the threads, and a part one
    g = torch.Generator().manual_seed(M * K)
    N = 37 if K != 640 else 37 * 32
    weight, x = torch.randn(N, K, generator=g).bfloat16(), _rows(M, K, torch.bfloat16, seed=M)
    bias = _bias(N, torch.bfloat16, with_bias)
    assert gemv_cpu.bf16_supported(x, weight) == (M <= gemv_cpu.bf16_rows_max())
    for loop in _bf16_loops():
        with loop():
            got = _same_as_alone(gemv_cpu.bf16_gemv, x, weight, bias)
        _check(got, *_exact(x, weight.double(), bias), torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("M", [5, 33])
def test_bf16_rows_apart_and_a_nan_row_leave_the_others_alone(M):
    # weight rows 700 elements apart (a view into a wider table); a NaN in one row of x and an infinity in another:
    # those rows' outputs are not finite, the others' are the ones they have without them
    g = torch.Generator().manual_seed(M)
    weight = torch.randn(101, 700, generator=g).bfloat16()[:, 30:670]
    x, bias = _rows(M, 640, torch.bfloat16, seed=M), _bias(101, torch.bfloat16, True)
    clean = x.clone()
    x[2, 7], x[M - 1, 0] = float("nan"), float("inf")
    others = [m for m in range(M) if m not in (2, M - 1)]
    for loop in _bf16_loops():
        with loop():
            got = _same_as_alone(gemv_cpu.bf16_gemv, x, weight, bias)
            assert torch.equal(got[others].view(torch.int16), gemv_cpu.bf16_gemv(clean, weight, bias)[others].view(
                torch.int16))
        assert torch.isnan(got[2]).all() and not torch.isfinite(got[M - 1]).any()
        _check(got[others], *_exact(clean[others], weight.double(), bias), torch.bfloat16)


needs_amx = pytest.mark.skipif("AMX-BF16" not in cpu_library.bf16_loops(),
                               reason="no AMX-BF16 loop here: the CPU lacks AMX-TILE/AMX-BF16, the compiler or OS "
                                      "does not allow the tiles, or the C kernels are not built")


@needs_amx
@pytest.mark.parametrize("N", [1, 15, 16, 17, 100, 1000])  # tiles of 16 weight rows and groups of 32, in part
@pytest.mark.parametrize("K", [32, 64, 100, 640])  # chunks of 32 columns, whole and a part one
@pytest.mark.parametrize("M", [1, 3, 16, 17, 33, 64])  # B tiles of 16 rows of x and passes of 32, in part
def test_bf16_amx_rows_match_the_exact_product_and_each_row_alone(N, K, M):
    # the weight rows apart (a view into a wider table) for odd N, so tiles load with a stride other than K; a bias
    # where M is odd
    g = torch.Generator().manual_seed(N * K + M)
    table = torch.randn(N, K + 7 * (N % 2), generator=g).bfloat16()
    weight = table[:, N % 2 * 3 : N % 2 * 3 + K]
    x, bias = _rows(M, K, torch.bfloat16, seed=M), _bias(N, torch.bfloat16, M % 2 == 1)
    assert gemv_cpu.bf16_supported(x, weight)
    with cpu_library.with_bf16_loop("AMX-BF16"):
        got = _same_as_alone(gemv_cpu.bf16_gemv, x, weight, bias)
    _check(got, *_exact(x, weight.double(), bias), torch.bfloat16)


@needs_amx
def test_bf16_amx_rows_keep_their_bits_in_any_batch():
    # a row's outputs are the same bits in batches of every size and position, through the AMX loop
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(1000, 640, generator=g).bfloat16(), _rows(64, 640, torch.bfloat16, seed=5)
    with cpu_library.with_bf16_loop("AMX-BF16"):
        full = gemv_cpu.bf16_gemv(x, weight)
        for lo, hi in [(0, 1), (40, 41), (3, 20), (0, 16), (17, 50), (30, 64)]:
            assert torch.equal(gemv_cpu.bf16_gemv(x[lo:hi], weight).view(torch.int16), full[lo:hi].view(torch.int16))


@needs_amx
@pytest.mark.parametrize("N", [8192, 8209])  # outputs of 33 rows past 512 KiB, written around the caches; N odd too
def test_bf16_amx_large_outputs_have_the_bits_of_small_ones(N):
    # a large y is stored by other instructions than a one-row call's small one: the same bits, the bias included
    g = torch.Generator().manual_seed(N)
    weight, x = torch.randn(N, 96, generator=g).bfloat16(), _rows(33, 96, torch.bfloat16, seed=N)
    bias = _bias(N, torch.bfloat16, True)
    with cpu_library.with_bf16_loop("AMX-BF16"):
        got = _same_as_alone(gemv_cpu.bf16_gemv, x, weight, bias)
    _check(got, *_exact(x, weight.double(), bias), torch.bfloat16)


@needs_amx
def test_bf16_rows_take_the_amx_loop_first_and_the_switches_choose():
    assert cpu_library.bf16_loops() == ["AMX-BF16", "AVX512-BF16"]  # every AMX CPU has AVX512-BF16
    assert cpu_library.bf16_loop() == "AMX-BF16" and "bf16 rows through AMX-BF16" in cpu_library.describe()
    with cpu_library.bf16_without_amx():
        assert cpu_library.bf16_loop() == "AVX512-BF16" and "bf16 rows through AVX512-BF16" in cpu_library.describe()
        assert gemv_cpu.bf16_rows_max() == gemv_cpu.ROWS_MAX["bf16"]
        with cpu_library.bf16_without_dot():
            assert cpu_library.bf16_loop() == "" and "bf16 rows" not in cpu_library.describe()
        assert cpu_library.bf16_loop() == "AVX512-BF16"
    assert cpu_library.bf16_loop() == "AMX-BF16" and gemv_cpu.bf16_rows_max() == gemv_cpu.ROWS_MAX["bf16"]


@needs_kernels
def test_a_bf16_loop_the_cpu_lacks_is_refused():
    with pytest.raises(ValueError, match="this CPU has no nonsense loop"):
        cpu_library.with_bf16_loop("nonsense")
    before = cpu_library.bf16_loop()
    with cpu_library.bf16_without_amx():  # where there is no AVX512-BF16 loop, the loop taken stays as it was
        assert cpu_library.bf16_loop() == ("AVX512-BF16" if "AVX512-BF16" in cpu_library.bf16_loops() else before)
    assert cpu_library.bf16_loop() == before


@needs_kernels
def test_bf16_rows_up_to_rows_max_through_the_avx512_bf16_loop():
    # 64 rows where the CPU has AVX512-BF16 (and the loop is on), else the fp32 loop's 4; one row without the C
    # kernels' rows (one_row_only)
    weight = torch.randn(40, 256).bfloat16()
    most = gemv_cpu.ROWS_MAX["bf16"] if cpu_library.bf16_dot() else gemv_cpu.BF16_FP32_LOOP_ROWS
    assert gemv_cpu.bf16_rows_max() == most
    assert gemv_cpu.bf16_supported(torch.zeros(most, 256).bfloat16(), weight)
    assert not gemv_cpu.bf16_supported(torch.zeros(most + 1, 256).bfloat16(), weight)
    with cpu_library.bf16_without_dot():
        assert gemv_cpu.bf16_rows_max() == gemv_cpu.BF16_FP32_LOOP_ROWS
        assert not cpu_library.bf16_dot()
    with gemv_cpu.one_row_only():
        assert gemv_cpu.bf16_rows_max() == 1
    assert not gemv_cpu.bf16_supported(torch.zeros(2, 256), weight.float())  # fp32 rows and weight: PyTorch's


@needs_kernels
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,group_size", [(256, 32), (640, 128), (512, -1), (2048, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_rows_are_each_row_alone(M, K, group_size, symmetric, dtype, bits):
    # 19 outputs: a tile of 16 (the AVX512-VNNI loop's over tiles) and 3 of a padded one
    weight = _int(19, K, group_size, symmetric, seed=K + bits, bits=bits)
    x = _rows(M, K, dtype, seed=M)
    bias = _bias(19, dtype, M % 2 == 1)
    w = weight.dequantize(torch.float32).double()
    group = K if group_size == -1 else group_size
    vnni = bits == 4 and group % 64 == 0 and dtype != torch.float32
    for path, is_vnni in _int4_loops():
        with path():
            got = _same_as_alone(gemv_cpu.int_gemv, x, weight, bias)
            # 8-bit codes take a VNNI loop only over tiles: groups of 16 to 512, AVX512-VNNI
            tiles8 = (bits == 8 and dtype != torch.float32 and group % 16 == 0 and group <= 512
                      and cpu_library.int4_vnni() == "AVX512-VNNI")
        fixed = torch.cat([_fixed_point_error(row, w, group) for row in x]) if vnni and is_vnni or tiles8 else 0.0
        exact, magnitude = _exact(x, w, bias)
        _check(got, exact, magnitude + _factored(x, weight), dtype, fixed)
        # and the reference, within the one-row dispatch test's tolerance (plus the fixed point's, where it applies)
        slack = float(fixed.max()) if torch.is_tensor(fixed) else 0.0
        torch.testing.assert_close(got, dequant_linear_ref(x, weight, bias), rtol=2e-2, atol=2e-2 + slack)


@needs_kernels
@pytest.mark.parametrize("M", [5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_rows_each_choose_their_own_loop(M, dtype):
    # a row with a NaN (or an infinity) takes the float loop, its neighbours the VNNI one: each still has its bits
    # alone, and the other rows' outputs are the ones they have without it
    weight = _int(40, 256, 128, False)
    x = _rows(M, 256, dtype, seed=3)
    clean = x.clone()
    x[2, 7], x[M - 1, 0] = float("nan"), float("inf")
    others = [m for m in range(M) if m not in (2, M - 1)]
    for path, _ in _int4_loops():
        with path():
            got = _same_as_alone(gemv_cpu.int_gemv, x, weight)
            assert torch.equal(got[others], gemv_cpu.int_gemv(clean, weight)[others])
        assert torch.isnan(got[2]).all() and not torch.isfinite(got[M - 1]).any()
        assert torch.isfinite(got[others]).all()


@needs_kernels
def test_int4_rows_up_to_rows_max_where_the_tiles_apply():
    # the AVX512-VNNI loop over tiles takes bf16 and fp16 batches of up to ROWS_MAX["int4"] rows, groups of 64 or
    # more; elsewhere (fp32 rows, groups of 32, no AVX512-VNNI, or switched off) 4-bit calls take one row
    weight, small = _int(40, 256, 128, False), _int(40, 256, 32, False)
    most = gemv_cpu.ROWS_MAX["int4"]
    tiled = cpu_library.int4_vnni() == "AVX512-VNNI"
    for M, dtype, w in [(2, torch.bfloat16, weight), (most, torch.float16, weight), (2, torch.float32, weight),
                        (2, torch.bfloat16, small)]:
        want = tiled and dtype != torch.float32 and w is weight
        assert gemv_cpu.int_supported(torch.zeros(M, 256, dtype=dtype), weight if w is weight else small) == want
    assert not gemv_cpu.int_supported(torch.zeros(most + 1, 256, dtype=torch.bfloat16), weight)
    with cpu_library.without_vnni():
        assert not gemv_cpu.int_supported(torch.zeros(2, 256, dtype=torch.bfloat16), weight)
    with gemv_cpu.one_row_only():
        assert not gemv_cpu.int_supported(torch.zeros(2, 256, dtype=torch.bfloat16), weight)
    tuned = QuantizedWeight(weight.qweight, weight.scale.clone().requires_grad_(), weight.zero, 4, 128, weight.shape)
    assert not gemv_cpu.int_supported(torch.zeros(2, 256, dtype=torch.bfloat16), tuned)  # C has no gradients
    with torch.no_grad():
        assert gemv_cpu.int_supported(torch.zeros(2, 256, dtype=torch.bfloat16), tuned) == tiled


@needs_kernels
def test_int8_rows_up_to_rows_max_where_the_tiles_apply():
    # 8-bit codes take the loop over tiles (bf16 and fp16 batches of up to ROWS_MAX["int4"] rows) for groups of 16 to
    # 512, where its int32 sums cannot overflow; elsewhere ROWS_MAX["int"] rows, as before the tiles
    grouped, channel = _int(40, 640, 128, False, bits=8), _int(40, 640, -1, False, bits=8)  # a group of 640
    most, few = gemv_cpu.ROWS_MAX["int4"], gemv_cpu.ROWS_MAX["int"]
    tiled = cpu_library.int4_vnni() == "AVX512-VNNI"
    assert gemv_cpu.int_supported(torch.zeros(most, 640, dtype=torch.bfloat16), grouped) == tiled
    assert gemv_cpu.int_supported(torch.zeros(few + 1, 640, dtype=torch.float16), grouped) == tiled
    assert not gemv_cpu.int_supported(torch.zeros(most + 1, 640, dtype=torch.bfloat16), grouped)
    for w, dtype in [(grouped, torch.float32), (channel, torch.bfloat16)]:
        assert gemv_cpu.int_supported(torch.zeros(few, 640, dtype=dtype), w)
        assert not gemv_cpu.int_supported(torch.zeros(few + 1, 640, dtype=dtype), w)
    with cpu_library.without_vnni():
        assert not gemv_cpu.int_supported(torch.zeros(few + 1, 640, dtype=torch.bfloat16), grouped)


@needs_kernels
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K", [72, 640, 2080])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_rows_are_each_row_alone(M, K, granularity, dtype):
    weight = _fp8(29, K, granularity, seed=M)
    x, bias = _rows(M, K, dtype, seed=M), _bias(29, dtype, M % 2 == 0)
    got = _same_as_alone(gemv_cpu.fp8_gemv, x, weight, bias)
    w = weight.weight.double() * weight.scale.double()
    _check(got, *_exact(x, w, bias), dtype)


@needs_kernels
def test_rows_keep_their_leading_dimensions_and_the_operators_take_them():
    weight, packed, fp8 = torch.randn(48, 128).bfloat16(), _int(40, 128, 32, False), _fp8(24, 128, "tensor")
    x = torch.randn(2, 3, 128).bfloat16()
    assert gemv_cpu.bf16_gemv(x, weight).shape == (2, 3, 48)
    torch.library.opcheck(torch.ops.qinfer.bf16_gemv, (x, weight, None))
    torch.library.opcheck(torch.ops.qinfer.int_gemv, (x, packed.qweight, packed.scale, packed.zero, 4, 32, None))
    torch.library.opcheck(torch.ops.qinfer.fp8_gemv, (x, fp8.weight, fp8.scale, None),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@needs_kernels
def test_linear_on_rows_gives_each_row_alone():
    # the serving engine's batched decode step: a sequence's outputs do not depend on the others in its batch
    g = torch.Generator().manual_seed(11)
    weights = {"bf16": torch.randn(96, 256, generator=g).bfloat16(), "int4": _int(96, 256, 64, False),
               "int": _int(96, 256, 64, True, bits=3), "fp8": _fp8(96, 256, "channel")}
    bias = torch.randn(96, generator=g).bfloat16()
    for kind, w in weights.items():
        rows = gemv_cpu.bf16_rows_max() if kind == "bf16" else gemv_cpu.ROWS_MAX[kind]
        for M in sorted(m for m in {1, 2, 5, rows} if m <= rows):
            x = _rows(M, 256, torch.bfloat16, seed=M)
            got = linear(x, w, bias)
            alone = torch.cat([linear(row[None], w, bias) for row in x])
            assert torch.equal(got, alone), (kind, M)
        assert not gemv_cpu.int_supported(torch.randn(rows + 1, 256), w) if kind.startswith("int") else True


def test_rows_max_bounds_the_calls():
    assert all(1 <= rows for rows in gemv_cpu.ROWS_MAX.values())
    weight = torch.randn(8, 64).bfloat16()
    assert not gemv_cpu.bf16_supported(torch.randn(gemv_cpu.ROWS_MAX["bf16"] + 1, 64).bfloat16(), weight)
    assert not gemv_cpu.bf16_supported(torch.randn(0, 64).bfloat16(), weight)
    assert not isinstance(weight, Fp8Weight)
