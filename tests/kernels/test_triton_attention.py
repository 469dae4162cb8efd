"""The Triton paged-attention kernels against the torch references, in Triton's interpreter on CPU
(tests/conftest.py sets ``TRITON_INTERPRET=1`` there), over odd shapes: sequences of 1, 5, 123 and 1000
positions in shuffled, partly filled blocks, head_dim 64/128/256, GQA ratios 1/4/8, windows, bf16/int8/FP8
pages; and compiled for Hopper, which checks what the interpreter does not."""

import textwrap

import pytest
import torch

from qinfer.kernels import triton_attention
from qinfer.kernels.paged_attention import gather_ref, paged_decode_ref, paged_prefill_ref
from tests.kernels.test_paged_attention import CODES, _fill
from tests.kernels.triton_compile import compile_in_subprocess

SHAPES = [(64, 1), (128, 4), (256, 8)]  # (head_dim, query heads per KV head)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("D, group", SHAPES)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_matches_the_reference(kv_dtype, D, group, window):
    Hkv, P, lengths = 2, 16, [1, 5, 123, 1000]
    k_pages, v_pages, scales, tables, _ = _fill(lengths, Hkv, D, P, kv_dtype)
    if kv_dtype == "bf16":
        k_pages, v_pages = k_pages.bfloat16(), v_pages.bfloat16()
    q = torch.randn(len(lengths), Hkv * group, D).bfloat16()
    lens = torch.tensor(lengths)
    out = triton_attention.paged_decode(q, k_pages, v_pages, tables, lens, D ** -0.5, window, **scales)
    expected = paged_decode_ref(q, k_pages, v_pages, tables, lens, D ** -0.5, window, **scales)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=1e-2)  # (one bf16 rounding each)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("shape, start, T, window", [
    (SHAPES[0], 0, 5, None), (SHAPES[1], 13, 20, None), (SHAPES[2], 100, 23, 16), (SHAPES[0], 0, 123, 32),
])
def test_paged_prefill_writes_and_attends_as_the_reference(kv_dtype, shape, start, T, window):
    (D, group), Hkv, P = shape, 2, 16
    ours = _fill([start + T], Hkv, D, P, kv_dtype, seed=1)
    theirs = _fill([start + T], Hkv, D, P, kv_dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(T, Hkv * group, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    outs = []
    for (k_pages, v_pages, scales, tables, _), run in ((ours, triton_attention.paged_prefill),
                                                       (theirs, paged_prefill_ref)):
        outs.append(run(q, k, v, k_pages, v_pages, tables[0], start, D ** -0.5, window, **scales))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    # the chunk's pages hold what the reference wrote: the same codes and scales
    for ours_pages, theirs_pages in zip(ours[:2], theirs[:2]):
        assert torch.equal(ours_pages.view(torch.uint8) if kv_dtype == "fp8" else ours_pages,
                           theirs_pages.view(torch.uint8) if kv_dtype == "fp8" else theirs_pages)
    for name in ("k_pos", "v_pos") if kv_dtype != "bf16" else ():
        torch.testing.assert_close(ours[2][name], theirs[2][name], rtol=1e-6, atol=0)


def test_e4m3_rounding_matches_torch_on_every_code_boundary():
    # every E4M3 value, the midpoints between neighbours (ties to even) and points just either side of them
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[torch.isfinite(values)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    y = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    y = y[y.abs() <= 448]
    x = y[:, None, None].expand(-1, 1, 16).contiguous()  # one position per value, each row constant
    c = torch.ones(1, 16)
    pages = torch.zeros(len(y), 1, 1, 16, dtype=torch.float8_e4m3fn)
    pos = torch.zeros(len(y), 1, 1)
    table = torch.arange(len(y), dtype=torch.int32)
    # scale 1 exactly: a row whose largest value is 448 has position scale 1
    x = torch.where(torch.arange(16) == 0, torch.tensor(448.0), x)
    triton_attention._write_kernel[(len(y), 1)](x, pages.view(torch.uint8), c, pos, table, 0, 1, 1, x.stride(0),
                                               x.stride(1), D=16, CODE=2, QMAX=448.0)
    assert torch.equal(pos.flatten(), torch.ones(len(y)))
    assert torch.equal(pages.view(torch.uint8)[:, 0, 0, 1:], x[:, 0, 1:].to(torch.float8_e4m3fn).view(torch.uint8))


def test_costs_count_what_a_kernel_must_move():
    b, f = triton_attention.decode_cost([4096], H=8, Hkv=2, D=128, kv_bytes=1)
    assert b == 2 * 4096 * 2 * (128 + 4) + 2 * 2 * 8 * 128 and f == 4 * 4096 * 8 * 128
    b, _ = triton_attention.decode_cost([4096], H=8, Hkv=2, D=128, kv_bytes=2, window=512)
    assert b == 2 * 512 * 2 * 128 * 2 + 2 * 2 * 8 * 128


_COMPILE = textwrap.dedent("""
    import json, sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qinfer.kernels import triton_attention as ta

    for code, D, G in json.loads(sys.argv[1]):
        page = {0: "*bf16", 1: "*i8", 2: "*u8"}[code]
        runs = [
            (ta._decode_kernel, ["q_ptr:*bf16", f"k_ptr:{page}", f"v_ptr:{page}", "ks_ptr:*fp32", "vs_ptr:*fp32",
                                 "kp_ptr:*fp32", "vp_ptr:*fp32", "bt_ptr:*i32", "len_ptr:*i32", "o_ptr:*fp32",
                                 "m_ptr:*fp32", "l_ptr:*fp32", "scale:fp32", "Hkv:i32", "P:i32", "stride_qb:i32",
                                 "stride_qh:i32", "stride_bt:i32", "window:i32", "SPLITS:i32"],
             dict(G=G, GP=max(2, triton.next_power_of_2(G)), D=D, CODE=code, WINDOW=True, BLOCK=ta.BLOCK_N,
                  SPLIT_LEN=ta.SPLIT)),
            (ta._prefill_kernel, ["q_ptr:*bf16", f"k_ptr:{page}", f"v_ptr:{page}", "ks_ptr:*fp32", "vs_ptr:*fp32",
                                  "kp_ptr:*fp32", "vp_ptr:*fp32", "bt_ptr:*i32", "out_ptr:*fp32", "start:i32",
                                  "T:i32", "scale:fp32", "Hkv:i32", "P:i32", "stride_qt:i32", "stride_qh:i32",
                                  "stride_ot:i32", "stride_oh:i32", "window:i32"],
             dict(G=G, D=D, CODE=code, WINDOW=True, BM=ta.BLOCK_M, BN=ta.BLOCK_N)),
            (ta._write_kernel, ["x_ptr:*bf16", f"pages_ptr:{page}", "c_ptr:*fp32", "pos_ptr:*fp32", "bt_ptr:*i32",
                                "start:i32", "Hkv:i32", "P:i32", "stride_xt:i32", "stride_xh:i32"],
             dict(D=D, CODE=code, QMAX=ta.QMAX.get(code, 1.0))),
        ]
        for fn, args, consts in runs:
            sig = dict(a.split(":") for a in args) | {k: "constexpr" for k in consts}
            where = {(list(sig).index(k),): v for k, v in consts.items()}
            kernel = triton.compile(ASTSource(fn, sig, constexprs=where), target=GPUTarget("cuda", 90, 32))
            assert kernel.asm["cubin"], (code, D, G, fn)
            print(code, D, G, fn.__name__)
""")
_TARGETS = [(code, D, G) for code in (0, 1, 2) for D, G in SHAPES]


def test_kernels_compile_for_hopper(tmp_path):
    assert len(compile_in_subprocess(_COMPILE, _TARGETS, tmp_path, timeout=900)) == 3 * len(_TARGETS)


def test_gather_of_the_reference_reads_through_the_table():
    pages = torch.arange(3 * 1 * 2 * 1, dtype=torch.float32).view(3, 1, 2, 1)  # block b row r holds 2b + r
    out = gather_ref(pages, torch.tensor([2, 0]), 1, 4)  # positions 1..3: block 2 row 1, block 0 rows 0-1
    assert out.flatten().tolist() == [5.0, 0.0, 1.0]
    assert CODES["int8"] == torch.int8
