"""RMSNorm: the C rows of a decode step against the plain-torch reference, and which inputs go where."""

import pytest
import torch

from qinfer.kernels import cpu_library, gemv_cpu, norm_cpu
from qinfer.kernels.norm import rms_norm, rms_norm_ref

needs_kernels = pytest.mark.skipif(not cpu_library.available(),
                                   reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
# the reference up to one rounding of its output (the C loop sums the squares in another order)
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@needs_kernels
@pytest.mark.parametrize("rows,D", [(1, 640), (4, 256), (16, 64), (3, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemma,weight_fp32", [(True, True), (True, False), (False, False)])
def test_c_rows_match_the_reference(rows, D, dtype, gemma, weight_fp32):
    g = torch.Generator().manual_seed(rows * D)
    x = (torch.randn(rows, D, generator=g) * 3).to(dtype)
    x[0, :3] = 0.0  # zeros, and a row's scale far from 1
    if rows > 1:
        x[1] *= 1e-4  # a mean square far below eps: eps sets the scale
    if rows > 2:
        x[2] = 0.0  # a row of zeros: zeros, not 0/0
    weight = (torch.randn(D, generator=g) * 0.3).to(torch.float32 if weight_fp32 else dtype)
    offset = 1.0 if gemma else 0.0
    assert norm_cpu.rms_norm_supported(x, weight, gemma)
    got, ref = rms_norm(x, weight, 1e-6, offset, gemma), rms_norm_ref(x, weight, 1e-6, offset, gemma)
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=RTOL[dtype], atol=0)
    xd = x.double()  # and the exact norm, for fp32 (where the reference rounds nothing but its fp32 steps)
    exact = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (offset + weight.double())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=4e-6, atol=1e-30)


@needs_kernels
def test_a_model_shaped_row_and_what_stays_with_the_reference():
    w = torch.randn(256) * 0.1
    q = torch.randn(1, 1, 4 * 256).bfloat16().view(1, 1, 4, 256).transpose(1, 2)  # [B, H, T=1, D]: contiguous
    assert norm_cpu.rms_norm_supported(q, w, True)
    torch.testing.assert_close(rms_norm(q, w, 1e-6, 1.0, True), rms_norm_ref(q, w, 1e-6, 1.0, True), rtol=2**-7, atol=0)
    apart = torch.randn(256, 8).T  # rows apart (a query head's slice of a fused q/k/v output): copied first
    assert norm_cpu.rms_norm_supported(apart, w, True)
    assert torch.equal(rms_norm(apart, w, 1e-6, 1.0, True), rms_norm(apart.contiguous(), w, 1e-6, 1.0, True))
    cases = [
        (torch.randn(norm_cpu.NORM_MAX_ROWS + 1, 256), w, True),  # a prefill's rows: PyTorch's ops
        (torch.randn(2, 256).bfloat16(), w, False),  # Llama's scale in a weight of another dtype
        (torch.randn(2, 256), w.clone().requires_grad_(), True),  # tuning: gradients through the norm
    ]
    for x, weight, gemma in cases:
        assert not norm_cpu.rms_norm_supported(x, weight, gemma)
        assert torch.equal(rms_norm(x, weight, 1e-6, 1.0, gemma), rms_norm_ref(x, weight, 1e-6, 1.0, gemma))
    with torch.no_grad():  # no gradient wanted: the C rows again
        assert norm_cpu.rms_norm_supported(torch.randn(2, 256), w.clone().requires_grad_(), True)
    with cpu_library.disabled():
        assert not norm_cpu.rms_norm_supported(q, w, True)
    with cpu_library.only_gemvs():
        assert not norm_cpu.rms_norm_supported(q, w, True)
        assert gemv_cpu.bf16_supported(q.reshape(1, -1), torch.randn(8, 1024).bfloat16())  # the GEMVs stay
    assert norm_cpu.rms_norm_supported(q, w, True)


@needs_kernels
def test_a_row_is_normed_alike_whatever_rows_share_the_call():
    # an engine step's decode rows: every query head of up to 64 sequences, through one loop
    x, w = torch.randn(64 * 8, 256).bfloat16(), torch.randn(256) * 0.1
    assert not norm_cpu.rms_norm_supported(x, w, True)  # a prefill's rows: PyTorch's ops, unless...
    with norm_cpu.all_rows():
        together = rms_norm(x, w, 1e-6, 1.0, True)
    assert all(torch.equal(together[i:i + 1], rms_norm(x[i:i + 1], w, 1e-6, 1.0, True)) for i in (0, 7, 300, 511))


@needs_kernels
def test_compiled_norm_is_the_reference_and_profiled_norm_an_operator():
    x, w = torch.randn(1, 640).bfloat16(), torch.randn(640) * 0.1
    f = torch.compile(lambda x: rms_norm(x, w, 1e-6, 1.0, True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), rms_norm_ref(x, w, 1e-6, 1.0, True), rtol=2**-7, atol=0)
    with torch.profiler.profile() as prof:
        y = rms_norm(x, w, 1e-6, 1.0, True)
    assert "qinfer::rms_norm" in {e.name for e in prof.events()}
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6, 1.0, True), rtol=2**-7, atol=0)
    torch.library.opcheck(torch.ops.qinfer.rms_norm.default, (x, w, 1e-6, 1.0, True))
