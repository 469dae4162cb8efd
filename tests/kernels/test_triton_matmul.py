"""The Triton dequant-matmul against its plain-torch reference: on a GPU where there is one, else in Triton's
interpreter on CPU (tests/conftest.py sets ``TRITON_INTERPRET=1`` there); and a quantized model run through it."""

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from qinfer.format import Fp8Weight, QuantizedWeight, QuantScheme
from qinfer.kernels import triton_matmul
from qinfer.kernels.quant_linear import dequant_linear_ref
from qinfer.model.loader import load_model
from qinfer.quantizers.fp8 import fp8_quantize
from tests.kernels.triton_compile import compile_in_subprocess
from qinfer.quantizers.rtn import rtn_quantize
from tests.tiny_models import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative error per output row against the fp32 reference: fp32 differs only in summation order (and on a GPU
# by W's rounding to tf32, 2^-11); a half output adds its own rounding (bf16 2^-9, fp16 2^-12 relative)
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-3, torch.bfloat16: 6e-3, torch.float16: 1e-3}
quant_linear_module = importlib.import_module("qinfer.kernels.quant_linear")


def _weight(N, K, bits, group_size, symmetric, seed=0) -> QuantizedWeight:
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    scheme = QuantScheme(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric)
    return rtn_quantize(W, scheme).to(DEVICE)


def _fp8_weight(N, K, granularity, seed=0) -> Fp8Weight:
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    W[:, :7] *= 1e-4  # codes down among E4M3's subnormals
    scheme = QuantScheme(method="fp8", bits=8, format="fp8", group_size=-1, fp8_granularity=granularity)
    return fp8_quantize(W, scheme).to(DEVICE)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


@pytest.mark.parametrize("M", [1, 5, 123])  # 1 and 5: the GEMV kernel; 123: the GEMM, a ragged last tile
@pytest.mark.parametrize(
    "bits,N,K,group_size,symmetric",
    [
        (4, 100, 384, 128, False),
        (4, 48, 96, 32, True),
        (3, 70, 200, -1, False),  # codes straddle bytes; K per channel, not a power of two
        (3, 36, 192, 64, True),
        (2, 52, 160, 32, False),
        (8, 40, 136, -1, True),
    ],
)
def test_kernel_matches_reference(M, bits, N, K, group_size, symmetric):
    weight = _weight(N, K, bits, group_size, symmetric)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = triton_matmul.dequant_matmul(x, weight)
    ref = triton_matmul.dequant_matmul_ref(x, weight)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert _rel_err(got, ref) < TOL[torch.float32]


@pytest.mark.parametrize("M", [1, 5, 123])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_kernel_matches_reference(M, granularity):
    weight = _fp8_weight(72, 200, granularity)
    x = torch.randn(M, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = triton_matmul.dequant_matmul(x, weight)
    assert got.shape == (M, 72)
    assert _rel_err(got, triton_matmul.dequant_matmul_ref(x, weight)) < TOL[torch.float32]


def test_every_fp8_code_dequantizes_exactly():
    # every finite E4M3 code (subnormals, zeros, both signs) times a scale, through the kernel's bit move:
    # x = one-hot rows pick single weights, so each output is one dequantized weight, with no sum to round
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[codes.float().isfinite()]  # the two NaN codes are never written
    weight = Fp8Weight(finite.reshape(2, -1).contiguous(), torch.tensor([[0.75], [3.0]])).to(DEVICE)
    K = weight.shape[1]
    want = (weight.weight.float() * weight.scale).T.cpu()  # [K, 2]
    got = triton_matmul.dequant_matmul(torch.eye(K, device=DEVICE), weight)  # the GEMM: row k picks column k
    assert torch.equal(got.cpu(), want)
    for k in range(0, K, 50):  # the GEMV, a few rows at a time
        rows = triton_matmul.dequant_matmul(torch.eye(K, device=DEVICE)[k : k + 5], weight)
        assert torch.equal(rows.cpu(), want[k : k + 5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 33])
def test_half_activations(dtype, M):
    weight = _weight(96, 256, 4, 64, False, seed=2)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    got = triton_matmul.dequant_matmul(x, weight)
    assert got.dtype == dtype
    assert _rel_err(got, triton_matmul.dequant_matmul_ref(x.float(), weight)) < TOL[dtype]


def test_reference_is_the_format_dequantization():
    # the kernel's reference and the model's reference path (W dequantized by the format, then a matmul) agree
    for bits, group_size, symmetric in ((4, 64, False), (3, -1, True), (8, 32, False)):
        weight = _weight(64, 256, bits, group_size, symmetric, seed=4)
        x = torch.randn(7, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        torch.testing.assert_close(triton_matmul.dequant_matmul_ref(x, weight), dequant_linear_ref(x, weight),
                                   rtol=1e-5, atol=1e-6)


def test_bias_leading_dims_and_strided_input():
    weight = _weight(40, 128, 4, 32, True, seed=6)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)[..., ::2]  # not contiguous
    bias = torch.randn(40).to(DEVICE)
    got = triton_matmul.dequant_matmul(x, weight, bias)
    assert got.shape == (2, 3, 40)
    assert _rel_err(got.view(6, 40), triton_matmul.dequant_matmul_ref(x, weight, bias).view(6, 40)) < TOL[torch.float32]


def test_bad_input_is_refused():
    weight = _weight(16, 64, 4, 32, False)
    with pytest.raises(ValueError, match="features"):
        triton_matmul.dequant_matmul(torch.randn(2, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        triton_matmul.dequant_matmul(torch.randn(2, 64, device=DEVICE).double(), weight)


@pytest.mark.parametrize("flags", [["--group-size", "32"], ["--bits", "8", "--format", "fp8"]])
def test_a_quantized_model_runs_through_the_kernel(tmp_path, monkeypatch, flags):
    # the model's linears sent to the Triton kernel (as on a GPU) give the CPU path's logits
    make_model("gemma3", tmp_path / "tiny")
    args = ["quantize", str(tmp_path / "tiny"), "--method", "rtn", *flags, "-o", str(tmp_path / "q")]
    proc = subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    model = load_model(tmp_path / "q", dtype=torch.float32)
    prompts = [torch.arange(20)[None] * 13 % 320, torch.tensor([[1, 17, 42, 99, 7]])]  # the GEMM; the GEMV
    with torch.no_grad():
        want = [model(ids) for ids in prompts]
        calls = []
        kernel = triton_matmul.dequant_matmul
        monkeypatch.setattr(quant_linear_module, "_on_triton", lambda device: True)
        rows = lambda x: x.numel() // x.shape[-1]  # noqa: E731
        monkeypatch.setattr(triton_matmul, "dequant_matmul", lambda x, *a: calls.append(rows(x)) or kernel(x, *a))
        got = [model(ids) for ids in prompts]
    # every quantized linear of the 3 blocks, each prompt, and an integer model's lm_head (int8 by default; FP8
    # keeps it dense)
    n = 21 + ("fp8" not in flags)
    assert calls == [20] * n + [5] * n
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


_COMPILE = textwrap.dedent("""
    import json, sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qinfer.kernels import triton_matmul as it

    ints = {k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_qn", "stride_sn", "stride_ym")}
    for cap, x, bits, G, zero in json.loads(sys.argv[1]):
        gemm = dict(INPUT_PRECISION="ieee" if x == "*fp32" else "tf32", **it._GEMM_BLOCKS)
        for fn, extra in ((it._gemm_kernel, gemm), (it._gemv_kernel, it._GEMV_BLOCKS)):
            consts = dict(G=G, BITS=8 if bits == "fp8" else bits, HAS_ZERO=zero, FP8=bits == "fp8", **extra)
            scale = "*fp32" if bits == "fp8" else "*fp16"
            sig = {"x_ptr": x, "qw_ptr": "*u8", "s_ptr": scale, "z_ptr": "*u8", "y_ptr": "*fp32", **ints}
            sig |= {k: "constexpr" for k in consts}
            where = {(list(sig).index(k),): v for k, v in consts.items()}
            kernel = triton.compile(ASTSource(fn, sig, constexprs=where), target=GPUTarget("cuda", cap, 32))
            assert kernel.asm["cubin"], (cap, x, bits, fn)
            # every offset a stride makes is 64-bit: rows x stride passes 2^31 (a full-logits quantized lm_head
            # of 2^18 outputs from 8193 rows on), where 32-bit offsets wrap to a write outside y
            uses = [line.split(" loc(")[0] for line in kernel.asm["ttir"].splitlines()
                    if "%stride" in line and "tt.func" not in line]
            assert uses and all("arith.extsi" in line for line in uses), (fn.__name__, uses)
            print(cap, x, bits, fn.__name__, "shared", kernel.metadata.shared)
""")
# (compute capability, x, bits or "fp8", G, asymmetric): Turing, Ampere, Hopper; each width once, and on
# every architecture 4 bits, 3 bits (codes that straddle bytes), FP8 and fp32 inputs (IEEE tl.dot)
_TARGETS = [
    (cap, x, bits, G, zero)
    for cap in (75, 80, 90)
    for x, bits, G, zero in (("*bf16", 4, 128, True), ("*fp32", 3, 200, False), ("*bf16", "fp8", 200, False))
] + [(80, "*fp16", 2, 32, True), (80, "*bf16", 8, 136, False)]


def test_kernels_compile_for_nvidia_gpus(tmp_path):
    assert len(compile_in_subprocess(_COMPILE, _TARGETS, tmp_path, timeout=600)) == 2 * len(_TARGETS)