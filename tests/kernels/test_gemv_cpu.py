"""The C one-row kernels against exact (float64) products, the dispatch to them, their build and their fallback."""

import functools
import gc
import os
import subprocess
import sys

import pytest
import torch

from qinfer.format import Fp8Weight, QuantizedWeight, QuantScheme, pack, unpack
from qinfer.kernels import cpu_library, gemv_cpu
from qinfer.kernels.linear import linear
from qinfer.kernels.quant_linear import dequant_linear_ref
from qinfer.quantizers.fp8 import fp8_quantize
from qinfer.quantizers.rtn import rtn_quantize

needs_kernels = pytest.mark.skipif(not cpu_library.available(),
                                   reason=f"no C GEMV here: {cpu_library.unavailable_reason()}")
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # one output rounding, relative


def _check(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, fixed=0.0) -> None:
    # each output: its exact value up to one rounding to dtype, an fp32 sum's error (K terms of |w x|) and
    # ``fixed``, the VNNI loop's x in fixed point (see _fixed_point_error)
    bound = exact.abs() * ROUNDING[dtype] + magnitude * 1e-6 + fixed + 1e-30
    assert got.dtype == dtype
    excess = (got.double() - exact).abs() / bound
    assert float(excess.max()) <= 1.0, float(excess.max())


def _fixed_point_error(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """What the 4-bit VNNI loop may add to each output: every x within max|x in its group| / 32766, times |w|
    (float64, [1, N])."""
    step = x.double().abs().reshape(-1, group).amax(dim=1).repeat_interleave(group) / 32766
    return step[None] @ w.abs().T


def _int4_loops():
    """Each loop a 4-bit row can take on this CPU, as (context that selects it, whether it is a VNNI one)."""
    loops = [(functools.partial(cpu_library.with_vnni, name), True) for name in cpu_library.vnni_loops()]
    return loops + [(cpu_library.without_vnni, False)]


def _bf16_loops():
    """Each loop bf16 rows can take on this CPU, as a context that selects it: the AMX-BF16 and AVX512-BF16 ones
    where it has them, and the fp32 one."""
    loops = [functools.partial(cpu_library.with_bf16_loop, name) for name in cpu_library.bf16_loops()]
    return loops + [cpu_library.bf16_without_dot]


def _int(N, K, group_size, symmetric, seed=0, bits=4) -> QuantizedWeight:
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    return rtn_quantize(W, QuantScheme(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric))


def _fp8(N, K, granularity, seed=0) -> Fp8Weight:
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    W[:, :7] *= 1e-4  # codes down among E4M3's subnormals
    scheme = QuantScheme(method="fp8", bits=8, format="fp8", group_size=-1, fp8_granularity=granularity)
    return fp8_quantize(W, scheme)


@needs_kernels
@pytest.mark.parametrize("N", [1, 5, 1001])
@pytest.mark.parametrize("K", [8, 72, 77, 640])  # the 32-wide loop, its 8-wide tail and a scalar tail (masked)
def test_bf16_row_matches_the_exact_product(N, K):
    g = torch.Generator().manual_seed(N * K)
    weight, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(1, K, generator=g).bfloat16()
    assert gemv_cpu.bf16_supported(x, weight)
    for loop in _bf16_loops():
        with loop():
            got = gemv_cpu.bf16_gemv(x, weight)
        assert got.shape == (1, N)
        _check(got, x.double() @ weight.double().T, x.double().abs() @ weight.double().abs().T, torch.bfloat16)


@needs_kernels
def test_bf16_rows_apart_bias_and_leading_dimensions():
    g = torch.Generator().manual_seed(3)
    table = torch.randn(300, 700, generator=g).bfloat16()
    weight = table[:, 20:660]  # rows 700 elements apart
    x, bias = torch.randn(1, 1, 640, generator=g).bfloat16(), torch.randn(300, generator=g).bfloat16()
    assert gemv_cpu.bf16_supported(x, weight)
    got = gemv_cpu.bf16_gemv(x, weight)
    assert got.shape == (1, 1, 300)
    _check(got, x.double() @ weight.double().T, x.double().abs() @ weight.double().abs().T, torch.bfloat16)
    with_bias = linear(x, weight, bias)
    _check(with_bias, x.double() @ weight.double().T + bias.double(),
           x.double().abs() @ weight.double().abs().T + bias.double().abs(), torch.bfloat16)
    assert not gemv_cpu.bf16_supported(x, table.T)  # columns apart: PyTorch's kernel
    past = gemv_cpu.bf16_rows_max() + 1
    assert not gemv_cpu.bf16_supported(torch.randn(past, 640).bfloat16(), weight)  # more rows: PyTorch's GEMM
    assert not gemv_cpu.bf16_supported(torch.randn(1, 639).bfloat16(), weight)  # a mismatch: torch's own error
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 639).bfloat16(), weight)


@needs_kernels
@pytest.mark.parametrize("N", [3, 4, 7, 272])  # whole blocks of 4 rows and the rows after them
@pytest.mark.parametrize("K,group_size", [(256, 32), (640, 64), (640, 128), (512, -1)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_row_matches_the_exact_product(N, K, group_size, symmetric, dtype, bits):
    weight = _int(N, K, group_size, symmetric, seed=N + K, bits=bits)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, 5] *= 40  # an outlier, as real activations have: the VNNI loop's steps are set by a group's largest
    assert gemv_cpu.int_supported(x, weight)
    w = weight.dequantize(torch.float32).double()
    group = K if group_size == -1 else group_size
    # the VNNI loops for 4-bit bf16/fp16 rows and (over tiles: groups of 16 to 512, AVX512-VNNI) 8-bit ones, else the
    # float loop (and below, always); fp32 rows keep fp32's precision
    tiles8 = bits == 8 and group % 16 == 0 and group <= 512
    vnni = (bits == 4 and group % 64 == 0 or tiles8) and dtype != torch.float32
    outs = []
    for path, is_vnni in _int4_loops():
        with path():
            outs.append(gemv_cpu.int_gemv(x, weight))
            on_vnni = is_vnni and (bits == 4 or cpu_library.int4_vnni() == "AVX512-VNNI")
        fixed = _fixed_point_error(x, w, group) if vnni and on_vnni else 0.0
        _check(outs[-1], x.double() @ w.T, x.double().abs() @ w.abs().T, dtype, fixed)
    if not vnni:  # no VNNI loop takes this row: whichever is selected, the float loop runs, the same bits
        assert all(torch.equal(out, outs[-1]) for out in outs)
    # (AVX-VNNI's loop and AVX512-VNNI's over tiles of 16 outputs take the same exact integer sums per group but
    # scale them in other fp32 orders: each within the bound above, not bit for bit the same)


@needs_kernels
def test_int4_rows_carry_nan_and_infinity_and_take_a_zero_row():
    # a NaN or infinity in x sends the row to the float loop (fixed point has no place for them): y is not finite
    weight = _int(16, 256, 128, False)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
        x[0, 3] = bad
        assert not torch.isfinite(gemv_cpu.int_gemv(x, weight)).any()
    assert torch.equal(gemv_cpu.int_gemv(torch.zeros(1, 256), weight), torch.zeros(1, 16))
    # x so small that a fixed-point step (max|x| / 16383) would be subnormal: the float loop, as precise as ever
    tiny = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)) * 1e-35
    w = weight.dequantize(torch.float32).double()
    error = (gemv_cpu.int_gemv(tiny, weight).double() - tiny.double() @ w.T).abs()
    assert float((error / (tiny.double().abs() @ w.abs().T)).max()) < 1e-5
    before = cpu_library.int4_vnni()
    assert before == (cpu_library.vnni_loops() or [""])[0]  # AVX512-VNNI where the CPU has both
    with cpu_library.without_vnni():
        assert not cpu_library.int4_vnni() and "4-bit codes" not in cpu_library.describe()
    assert cpu_library.int4_vnni() == before and (f"4-bit codes through {before}" in cpu_library.describe()) == bool(
        before)
    for name in cpu_library.vnni_loops():
        with cpu_library.with_vnni(name):
            assert cpu_library.int4_vnni() == name
    assert cpu_library.int4_vnni() == before
    missing = [name for name in cpu_library.VNNI_LOOPS.values() if name not in cpu_library.vnni_loops()]
    for name in missing + ["AVX10"]:
        with pytest.raises(ValueError, match="has no"):
            cpu_library.with_vnni(name)



@needs_kernels
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_a_group_of_zero_weights_with_a_large_scale_gives_exactly_zero(bits, symmetric):
    # AutoGPTQ stores a group of zeros with scale 2 / (2^b - 1) (older qinfer models: 1), far above the others':
    # the factored zero term's residue times that scale was -0.26 where the weights say 0 (VNNI loop, 4 bits)
    K, G = 2048, 128
    weight = _int(8, K, G, symmetric, seed=7, bits=bits)
    qweight, scale = weight.qweight.clone(), weight.scale.clone()
    zero = None if symmetric else weight.zero.clone()
    z = 1 << (bits - 1) if symmetric else 3
    codes = unpack(qweight, bits, K)
    codes[0] = z  # row 0: all zeros; row 1: one group of zeros
    codes[1, G : 2 * G] = z
    if zero is not None:
        zero[0], zero[1, 1] = z, z
    scale[0], scale[1, 1] = 1.0, 1.0
    weight = QuantizedWeight(pack(codes, bits), scale, zero, bits, G, (8, K))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)) * 4
    x[0, ::97] = 300.0  # outliers far from zero mean: sum q x and z sum x are large and nearly equal
    w = weight.dequantize(torch.float32).double()
    for dtype in (torch.bfloat16, torch.float32):
        for path, _ in _int4_loops():
            with path():
                y = gemv_cpu.int_gemv(x.to(dtype), weight).double()
            assert y[0, 0] == 0.0, (dtype, path)
            ref = x.to(dtype).double() @ w.T  # row 1 is its other groups alone
            assert abs(float(y[0, 1] - ref[0, 1])) <= 1e-2 * float(x.to(dtype).double().abs() @ w[1].abs())

@needs_kernels
@pytest.mark.parametrize("N,K", [(3, 8), (272, 640), (5, 72)])  # the 32-wide loop and its 8-wide tail
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_row_matches_the_exact_product(N, K, granularity, dtype):
    weight = _fp8(N, K, granularity, seed=N)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert gemv_cpu.fp8_supported(x, weight)
    got = gemv_cpu.fp8_gemv(x, weight)
    w = weight.weight.double() * weight.scale.double()  # every code, subnormals too, as PyTorch reads it
    _check(got, x.double() @ w.T, x.double().abs() @ w.abs().T, dtype)


@needs_kernels
@pytest.mark.parametrize("kind", ["bf16", "int4", "int8", "int3", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bias_is_added_before_the_one_rounding(kind, dtype):
    # x has one nonzero entry (of 7 significant bits; 2 against 8-bit codes), so each row's product is exact in
    # fp32 and the output is that plus the bias, rounded once (as torch's linear rounds it); rounding the
    # product first, then the sum, misses on some rows
    N, K, g = 4096, 128, torch.Generator().manual_seed(7)
    x = torch.zeros(1, K, dtype=dtype)
    x[0, 37] = 0.75 if kind == "int8" else 91 / 128
    bias = torch.randn(N, generator=g).to(dtype)
    if kind == "bf16":
        weight = torch.randn(N, K, generator=g).bfloat16()
        w, x = weight.double(), x.bfloat16()
        bias = bias.bfloat16()
    elif kind == "fp8":  # scales of 8 significant bits: products exact
        codes = (torch.randn(N, K, generator=g) * 20).to(torch.float8_e4m3fn)
        weight = Fp8Weight(codes, torch.rand(N, 1, generator=g).bfloat16().float())
        w = codes.double() * weight.scale.double()
    else:
        weight = _int(N, K, 32, False, bits={"int4": 4, "int8": 8, "int3": 3}[kind])
        w = weight.dequantize(torch.float64)
    product = (x.double() @ w.T).float()  # exact
    assert torch.equal(product.double(), x.double() @ w.T)
    expected = (product + bias.float()).to(x.dtype)
    assert not torch.equal(product.to(x.dtype) + bias, expected)  # rounding twice differs on some rows
    assert torch.equal(linear(x, weight, bias), expected)


@needs_kernels
def test_every_finite_e4m3_code_is_read_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[codes.float().isfinite()]  # E4M3's two NaN codes are never written (the format refuses them)
    weight = Fp8Weight(codes.reshape(-1, 1).repeat(1, 8), torch.ones(codes.numel(), 1))
    x = torch.zeros(1, 8)
    x[0, 3] = 1.0  # each output is its row's code, exactly
    assert torch.equal(gemv_cpu.fp8_gemv(x, weight)[0], codes.float())


@needs_kernels
def test_int4_entry_point_dispatch_bias_and_permuted_columns():
    weight = _int(40, 256, 64, False, seed=5)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0)).int()
    permuted = QuantizedWeight(weight.qweight, weight.scale, weight.zero, 4, 64, weight.shape, perm)
    x, bias = torch.randn(1, 256).bfloat16(), torch.randn(40).bfloat16()
    for w in (weight, permuted):
        exact = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
        torch.testing.assert_close(linear(x, w, bias).double(), exact, rtol=2e-2, atol=2e-2)
        with cpu_library.disabled():  # PyTorch's int4 kernel, for the same row
            torch.testing.assert_close(linear(x, w, bias).double(), exact, rtol=2e-2, atol=2e-2)
    rows = torch.randn(gemv_cpu.ROWS_MAX["int4"] + 1, 256).bfloat16()
    assert not gemv_cpu.int_supported(rows, weight)
    rows_of_264 = rtn_quantize(torch.randn(40, 264), QuantScheme(method="rtn", bits=3, group_size=-1))
    assert not gemv_cpu.int_supported(torch.randn(1, 264).bfloat16(), rows_of_264)  # not a multiple of 16 long


@needs_kernels
@pytest.mark.parametrize("N,K,group_size", [(5, 64, 32), (40, 256, 64), (7, 640, 128), (3, 48, -1)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequantize_gives_the_references_bits(N, K, group_size, symmetric, dtype, bits):
    weight = _int(N, K, group_size, symmetric, seed=N * K, bits=bits)
    if dtype == torch.float16:
        weight.scale[0, 0] = 70000.0 / 3  # codes 3 and up, less the zero point, past fp16's range: inf
    assert gemv_cpu.dequantize_supported(weight, dtype)
    got = gemv_cpu.dequantize(weight, dtype)
    assert got.dtype == dtype and got.shape == (N, K)
    assert torch.equal(got, weight.dequantize(dtype))  # codes, zeros and scales as format.dequantize_codes reads them


@needs_kernels
def test_prefill_rows_of_4_bit_weights_are_dequantized_in_c(monkeypatch):
    # a prompt's rows (past int4_cpu's kernel) take the C dequantize, then the dense product: the reference's
    # numbers exactly; with permuted columns the product of the permuted rows and the stored columns (the same
    # terms, which the bf16 GEMM sums in another order)
    weight = _int(48, 256, 64, False, seed=6)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1)).int()
    permuted = QuantizedWeight(weight.qweight, weight.scale, weight.zero, 4, 64, weight.shape, perm)
    x, bias = torch.randn(300, 256).bfloat16(), torch.randn(48).bfloat16()
    calls = []
    monkeypatch.setattr(gemv_cpu, "dequantize", lambda w, dtype, f=gemv_cpu.dequantize: calls.append(w) or f(w, dtype))
    assert torch.equal(linear(x, weight, bias), dequant_linear_ref(x, weight, bias))
    torch.testing.assert_close(linear(x, permuted, bias), dequant_linear_ref(x, permuted, bias), rtol=2e-2, atol=2e-2)
    assert len(calls) == 2
    with cpu_library.pytorch_dequantize():  # the side-by-side timing's other path
        assert not gemv_cpu.dequantize_supported(weight, torch.bfloat16)
        assert torch.equal(linear(x, weight, bias), dequant_linear_ref(x, weight, bias)) and len(calls) == 2
    assert gemv_cpu.dequantize_supported(weight, torch.bfloat16)
    tuned = QuantizedWeight(weight.qweight, weight.scale.clone().requires_grad_(), weight.zero, 4, 64, weight.shape)
    assert not gemv_cpu.dequantize_supported(tuned, torch.bfloat16)  # a gradient through the scales: PyTorch's ops
    assert linear(x[:40], tuned).requires_grad
    assert not gemv_cpu.dequantize_supported(rtn_quantize(torch.randn(8, 72), QuantScheme(bits=4, group_size=-1)),
                                             torch.bfloat16)  # 4-bit rows of 72: not a multiple of 16
    assert gemv_cpu.dequantize_supported(rtn_quantize(torch.randn(8, 72), QuantScheme(bits=8, group_size=-1)),
                                         torch.bfloat16)  # 8-bit ones: a multiple of 8 will do


@needs_kernels
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_dequantize_gives_the_references_bits_and_serves_prefills(granularity, dtype, monkeypatch):
    weight = _fp8(40, 72, granularity, seed=4)  # subnormal codes in the first columns
    assert gemv_cpu.fp8_dequantize_supported(weight, dtype)
    got = gemv_cpu.fp8_dequantize(weight, dtype)
    assert got.dtype == dtype and torch.equal(got, weight.dequantize(dtype))
    calls = []
    monkeypatch.setattr(gemv_cpu, "fp8_dequantize", lambda w, d, f=gemv_cpu.fp8_dequantize: calls.append(w) or f(w, d))
    x = torch.randn(9, 72).to(dtype)  # a prompt's rows
    assert torch.equal(linear(x, weight), dequant_linear_ref(x, weight)) and len(calls) == 1
    apart = Fp8Weight(torch.cat([weight.weight, weight.weight], 1)[:, :72], weight.scale)  # rows 144 apart
    assert not gemv_cpu.fp8_dequantize_supported(Fp8Weight(weight.weight.T, torch.ones(1)), dtype)  # columns apart
    assert torch.equal(gemv_cpu.fp8_dequantize(apart, dtype), weight.dequantize(dtype))


@needs_kernels
def test_one_row_goes_to_the_c_kernels_unless_disabled(monkeypatch):
    calls = []
    run = gemv_cpu._run
    monkeypatch.setattr(gemv_cpu, "_run", lambda *a: calls.append(a[0].__name__) or run(*a))
    weights = (torch.randn(64, 128).bfloat16(), _int(64, 128, 32, True), _int(64, 128, 32, True, bits=8),
               _int(64, 128, 32, False, bits=3), _fp8(64, 128, "channel"))
    kernels = ["qinfer_bf16_gemv", "qinfer_int_gemv", "qinfer_int_gemv", "qinfer_int_gemv", "qinfer_fp8_gemv"]
    x = torch.randn(1, 128).bfloat16()
    for w in weights:
        linear(x, w)
    assert calls == kernels
    with cpu_library.disabled():
        assert not cpu_library.available()
        for w in weights:
            linear(x, w)
    assert calls == kernels and cpu_library.available()


@needs_kernels
def test_a_replaced_weight_is_read_anew_and_a_freed_one_is_forgotten():
    weight = torch.nn.Parameter(torch.randn(32, 64).bfloat16(), requires_grad=False)
    x = torch.randn(1, 64).bfloat16()
    before = len(gemv_cpu._PREPARED["bf16"])
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x.float(), weight.float()).bfloat16())
    weight.data = torch.randn(32, 64).bfloat16()  # the same Parameter, new memory (as AWQ folds scales in)
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x.float(), weight.float()).bfloat16())
    assert len(gemv_cpu._PREPARED["bf16"]) == before + 1
    del weight
    gc.collect()
    assert len(gemv_cpu._PREPARED["bf16"]) == before  # the store holds no tensor: the weight was freed


@needs_kernels
def test_compiled_calls_are_the_opaque_operators_and_match_eager():
    weight, packed, fp8 = torch.randn(48, 128).bfloat16(), _int(128, 128, 32, False), _fp8(128, 128, "tensor")
    x = torch.randn(1, 1, 128).bfloat16()
    for bias in (None, torch.randn(128).bfloat16()):
        torch.library.opcheck(torch.ops.qinfer.bf16_gemv, (x, weight, None if bias is None else bias[:48]))
        torch.library.opcheck(torch.ops.qinfer.int_gemv, (x, packed.qweight, packed.scale, packed.zero, 4, 32, bias))
        # (opcheck's schema test multiplies every tensor argument, which torch cannot do for float8 ones)
        torch.library.opcheck(torch.ops.qinfer.fp8_gemv, (x, fp8.weight, fp8.scale, bias),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def chain(x):  # biases too: the operators add them
        return linear(linear(linear(x, fp8, bias), packed, bias), weight, bias[:48])

    compiled = torch.compile(chain, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), chain(x))
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert {"qinfer.bf16_gemv", "qinfer.int_gemv", "qinfer.fp8_gemv"} <= targets, targets


def test_available_carries_the_mark_torch_compiler_sets_for_a_constant():
    # set by hand so that no command imports torch._dynamo to set it; the compiled test above needs it
    def f():
        return True

    assert torch.compiler.assume_constant_result(f) is f and vars(f) == {"_dynamo_marked_constant": True}
    assert cpu_library.available._dynamo_marked_constant is True


def test_the_commands_leave_torch_dynamo_unimported():
    # ~150 MiB of memory and a second of start-up in every command: imported only by what compiles
    code = ("import sys, qinfer.cli.commands, qinfer.pipeline.quantize, qinfer.engine.generate, qinfer.engine.chat, "
            "qinfer.evals.runner, qinfer.evals.speed, qinfer.kernels.linear; "
            "print(sorted(m for m in sys.modules if 'torch._dynamo' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_the_kernels_one_row_takes_pytorchs(monkeypatch, tmp_path):
    # no compiler, a compiler that fails, QINFER_CPU_GEMV=0 or no C source: not available, with the reason; rows
    # still multiply
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path))
    try:
        for env, value, reason in (("QINFER_CPU_GEMV", "0", "QINFER_CPU_GEMV=0"), ("CC", "/bin/false", "failed")):
            monkeypatch.setenv(env, value)
            cpu_library.library.cache_clear()
            assert not cpu_library.available() and reason in cpu_library.unavailable_reason()
            x, weight, packed = torch.randn(1, 64).bfloat16(), torch.randn(16, 64).bfloat16(), _int(16, 64, 32, True)
            torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x, weight))
            torch.testing.assert_close(linear(x, packed), dequant_linear_ref(x, packed), rtol=2e-2, atol=2e-2)
            monkeypatch.delenv(env)
        assert not list((tmp_path / "kernels").iterdir())  # the failed build left nothing behind
        monkeypatch.setattr(cpu_library, "_SOURCE_BYTES", None)  # an install without gemv_cpu.c
        cpu_library.library.cache_clear()
        assert not cpu_library.available() and "gemv_cpu.c is missing" in cpu_library.unavailable_reason()
    finally:
        cpu_library.library.cache_clear()


@needs_kernels
def test_the_library_is_built_from_the_source_this_module_was_loaded_with(tmp_path, monkeypatch):
    # the C file edited (here: replaced) while a process runs: its library still matches the calls it makes
    changed = tmp_path / "gemv_cpu.c"
    changed.write_text("int qinfer_bf16_gemv(void) { return 1; }\n")
    monkeypatch.setattr(cpu_library, "SOURCE", changed)
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path))
    cpu_library.library.cache_clear()
    try:
        assert cpu_library.available(), cpu_library.unavailable_reason()
        x, weight = torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()
        _check(gemv_cpu.bf16_gemv(x, weight), x.double() @ weight.double().T,
               x.double().abs() @ weight.double().abs().T, torch.bfloat16)
    finally:
        cpu_library.library.cache_clear()


def test_a_damaged_cached_library_is_built_again(tmp_path):
    """Loading a cut-short .so can crash the process (SIGBUS): its recorded sha256 is checked first."""
    probe = [sys.executable, "-c", "from qinfer.kernels import cpu_library; print(cpu_library.available())"]
    env = {**os.environ, "QINFER_CACHE": str(tmp_path)}
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "True"
    (built,) = (tmp_path / "kernels").glob("*.so")
    size = built.stat().st_size
    with open(built, "r+b") as f:
        f.truncate(1000)
    proc = subprocess.run(probe, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert built.stat().st_size == size
